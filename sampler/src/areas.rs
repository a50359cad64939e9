//! The CPUs' sample areas ([`SampleArea`]), mapped: the program writes its
//! ticks' direct records there, and the reader takes each area's records
//! in order, from its consumer position up to its producer position.
//!
//! Owns the checks a record passes before the reader trusts
//! it, and the consumer positions. Merging the areas' records with the
//! rings' is [`crate::rings`]'s.

use std::{
    io,
    ops::Range,
    sync::atomic::{AtomicU64, Ordering},
};

#[cfg(test)]
use agent_common::area_has_room;
use agent_common::{SAMPLE_AREA_BYTES, SAMPLE_AREA_SLACK, SampleArea, area_record_bytes};
use aya::maps::MapData;

use crate::mapped::MappedValues;

/// `SAMPLE_AREAS`, mapped for reading (and for storing the consumer
/// positions).
pub(crate) struct SampleAreas {
    areas: MappedValues<SampleArea>,
    /// Per area, what the reader knows of it.
    readers: Vec<AreaReader>,
    /// Records found bad (see [`AreaError`]): each time, the area's unread
    /// bytes were given up.
    bad_records: u64,
}

#[derive(Default, Clone, Copy)]
struct AreaReader {
    /// Where the next record starts: the consumer position as stored.
    consumer: u64,
    /// Where the record last returned by [`SampleAreas::next`] ends.
    next: u64,
}

impl SampleAreas {
    /// Maps `map`, an array of `count` areas created with `BPF_F_MMAPABLE`.
    pub(crate) fn map(map: MapData, count: usize) -> io::Result<Self> {
        // SAFETY: `count` areas mapped: the kernel refuses a mapping
        // larger than the map.
        MappedValues::map(map, count).map(|areas| unsafe { Self::new(areas, count) })
    }

    /// # Safety
    /// `areas` holds `count` areas.
    unsafe fn new(areas: MappedValues<SampleArea>, count: usize) -> Self {
        let mut readers = vec![AreaReader::default(); count];
        for (index, reader) in readers.iter_mut().enumerate() {
            // SAFETY: one of the caller's areas. A new map's areas read 0.
            let consumer = unsafe { position(areas.as_ptr().add(index), Position::Consumer) };
            reader.consumer = consumer.load(Ordering::Acquire);
            reader.next = reader.consumer;
        }
        Self {
            areas,
            readers,
            bad_records: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.readers.len()
    }

    /// Records found bad so far (each gave up its area's unread bytes).
    pub(crate) fn bad_records(&self) -> u64 {
        self.bad_records
    }

    /// Area `index`'s next unread record, if it has one. The reader must
    /// [`Self::consume`] it before asking for the area's next; until then
    /// the program writes around it.
    ///
    /// # Safety
    /// The record must not outlive `self`, nor the area's next
    /// [`Self::consume`].
    pub(crate) unsafe fn next<'r>(&mut self, index: usize) -> Option<&'r [u8]> {
        // SAFETY: one of our areas.
        let area = unsafe { self.areas.as_ptr().add(index) };
        // SAFETY: as above. Acquire: the record's bytes, stored before the
        // producer, are read after it.
        let producer = unsafe { position(area, Position::Producer) }.load(Ordering::Acquire);
        let reader = &mut self.readers[index];
        if producer == reader.consumer {
            return None;
        }
        // SAFETY: the offset of a position is within the data, and 8-aligned
        // (positions move by multiples of 8).
        let (data, length) = unsafe {
            let data = core::ptr::addr_of!((*area).data).cast::<u8>();
            let offset = (reader.consumer & (SAMPLE_AREA_BYTES as u64 - 1)) as usize;
            (data, data.add(offset).cast::<u64>().read_volatile())
        };
        match record_span(reader.consumer, producer, length) {
            Ok((bytes, end)) => {
                reader.next = end;
                // SAFETY: inside the area (checked), written before the
                // producer was, and not written again before the consumer
                // passes it.
                Some(unsafe { std::slice::from_raw_parts(data.add(bytes.start), bytes.len()) })
            }
            Err(err) => {
                tracing::warn!(
                    area = index,
                    "sample area: {err}; its unread records are lost"
                );
                reader.next = producer;
                self.bad_records += 1;
                self.consume(index);
                None
            }
        }
    }

    /// Marks area `index`'s last record read: the program may write over
    /// it.
    pub(crate) fn consume(&mut self, index: usize) {
        let reader = &mut self.readers[index];
        reader.consumer = reader.next;
        // SAFETY: one of our areas. Release: the record's bytes were read
        // before the program may see its room free.
        unsafe { position(self.areas.as_ptr().add(index), Position::Consumer) }
            .store(reader.consumer, Ordering::Release);
    }
}

enum Position {
    Producer,
    Consumer,
}

/// One of `area`'s positions, as an atomic: the program stores the
/// producer and the agent the consumer, each on its own side.
///
/// # Safety
/// `area` points to a live area.
unsafe fn position<'a>(area: *mut SampleArea, which: Position) -> &'a AtomicU64 {
    // SAFETY: the caller's; the positions are 8-aligned `u64`s.
    unsafe {
        AtomicU64::from_ptr(match which {
            Position::Producer => core::ptr::addr_of_mut!((*area).producer),
            Position::Consumer => core::ptr::addr_of_mut!((*area).consumer),
        })
    }
}

/// What makes a record in an area bad: the program never writes one, so
/// its area's positions or bytes were written by something else.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum AreaError {
    #[error("{unread} bytes unread, more than the area holds")]
    ProducerAhead { unread: u64 },
    #[error("a record of {length} bytes is shorter than any record")]
    TooShort { length: u64 },
    #[error("a record of {length} bytes at offset {offset} runs past the area's end")]
    PastEnd { length: u64, offset: usize },
    #[error("a record of {length} bytes runs past the {unread} bytes written")]
    PastProducer { length: u64, unread: u64 },
}

/// The record at position `consumer`, whose length word is `length`, in
/// an area written up to `producer`: where its bytes lie in the area's
/// data (slack included), and the position after it.
fn record_span(
    consumer: u64,
    producer: u64,
    length: u64,
) -> Result<(Range<usize>, u64), AreaError> {
    let unread = producer.wrapping_sub(consumer);
    if unread > SAMPLE_AREA_BYTES as u64 {
        return Err(AreaError::ProducerAhead { unread });
    }
    // Every record starts with a kind and ends past its time.
    if length < 16 {
        return Err(AreaError::TooShort { length });
    }
    let offset = (consumer & (SAMPLE_AREA_BYTES as u64 - 1)) as usize;
    let room = (SAMPLE_AREA_BYTES + SAMPLE_AREA_SLACK - offset) as u64;
    if length > room {
        return Err(AreaError::PastEnd { length, offset });
    }
    // No overflow: `length` is within the area.
    let bytes = area_record_bytes(length);
    if bytes > room {
        return Err(AreaError::PastEnd { length, offset });
    }
    if bytes > unread {
        return Err(AreaError::PastProducer { length, unread });
    }
    let start = offset + 8;
    Ok((start..start + length as usize, consumer + bytes))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const AREA: u64 = SAMPLE_AREA_BYTES as u64;

    impl SampleAreas {
        /// `count` zeroed areas on the heap, for tests.
        pub(crate) fn in_memory(count: usize) -> Self {
            // SAFETY: an area is integers only: all zeros is one.
            let areas = unsafe { Box::<[SampleArea]>::new_zeroed_slice(count).assume_init() };
            // SAFETY: `count` areas.
            unsafe { Self::new(MappedValues::in_memory(areas), count) }
        }

        /// Writes `record` to area `index` as the program does: unless
        /// there is no room for it (false).
        pub(crate) fn write(&mut self, index: usize, record: &[u8]) -> bool {
            // SAFETY: one of our areas; the test is its only writer.
            unsafe {
                let area = self.areas.as_ptr().add(index);
                let producer = position(area, Position::Producer).load(Ordering::Relaxed);
                let consumer = position(area, Position::Consumer).load(Ordering::Acquire);
                let bytes = area_record_bytes(record.len() as u64);
                if !area_has_room(producer, consumer, bytes) {
                    return false;
                }
                let data = core::ptr::addr_of_mut!((*area).data).cast::<u8>();
                let offset = (producer & (AREA - 1)) as usize;
                data.add(offset).cast::<u64>().write(record.len() as u64);
                std::ptr::copy_nonoverlapping(record.as_ptr(), data.add(offset + 8), record.len());
                position(area, Position::Producer).store(producer + bytes, Ordering::Release);
            }
            true
        }

        fn set_positions(&mut self, index: usize, producer: u64, length_at_consumer: u64) {
            // SAFETY: one of our areas.
            unsafe {
                let area = self.areas.as_ptr().add(index);
                let consumer = self.readers[index].consumer;
                let data = core::ptr::addr_of_mut!((*area).data).cast::<u8>();
                let offset = (consumer & (AREA - 1)) as usize;
                data.add(offset).cast::<u64>().write(length_at_consumer);
                position(area, Position::Producer).store(producer, Ordering::Release);
            }
        }
    }

    fn record(tag: u8, len: usize) -> Vec<u8> {
        let mut record = vec![tag; len];
        record[..4].copy_from_slice(&1u32.to_ne_bytes());
        record
    }

    /// Every record read from `areas`'s area `index`, consumed as read.
    fn read_all(areas: &mut SampleAreas, index: usize) -> Vec<Vec<u8>> {
        let mut read = Vec::new();
        // SAFETY: each record is copied before it is consumed.
        while let Some(record) = unsafe { areas.next(index) } {
            read.push(record.to_vec());
            areas.consume(index);
        }
        read
    }

    #[test]
    fn records_are_read_in_order_across_the_areas_end() {
        let mut areas = SampleAreas::in_memory(2);
        // Records of 33,000 bytes: the area's end falls inside one of the
        // first 32, which runs on into the slack.
        let mut written = Vec::new();
        for round in 0..3u8 {
            for n in 0..20u8 {
                let record = record(round * 20 + n, 33_000 + usize::from(n));
                assert!(
                    areas.write(1, &record),
                    "room for record {n} of round {round}"
                );
                written.push(record);
            }
            assert_eq!(read_all(&mut areas, 1), written);
            written.clear();
        }
        // Past 1 MiB in all: the area's end was crossed, some record ran
        // into the slack, and each came back whole.
        assert!(areas.readers[1].consumer > AREA);
        assert!(read_all(&mut areas, 0).is_empty());
        assert_eq!(areas.bad_records(), 0);
    }

    #[test]
    fn a_full_area_refuses_records_until_the_reader_consumes() {
        let mut areas = SampleAreas::in_memory(1);
        let record = record(7, 40_000);
        let mut written = 0;
        while areas.write(0, &record) {
            written += 1;
        }
        assert_eq!(written, AREA / area_record_bytes(40_000));
        // SAFETY: copied before it is consumed.
        let first = unsafe { areas.next(0) }.map(<[u8]>::to_vec);
        assert_eq!(first.as_deref(), Some(&record[..]));
        assert!(!areas.write(0, &record), "not consumed yet");
        areas.consume(0);
        assert!(areas.write(0, &record));
        assert_eq!(read_all(&mut areas, 0).len() as u64, written);
    }

    #[test]
    fn a_bad_record_gives_up_its_areas_unread_bytes_and_the_next_is_read() {
        let mut areas = SampleAreas::in_memory(1);
        // A length word past what was written.
        areas.set_positions(0, 64, 100);
        assert!(read_all(&mut areas, 0).is_empty());
        assert_eq!(areas.bad_records(), 1);
        assert_eq!(areas.readers[0].consumer, 64);
        // Records written after it are read.
        let record = record(3, 200);
        assert!(areas.write(0, &record));
        assert_eq!(read_all(&mut areas, 0), vec![record]);
        // A producer more than an area ahead.
        let consumer = areas.readers[0].consumer;
        areas.set_positions(0, consumer + AREA + 8, 200);
        assert!(read_all(&mut areas, 0).is_empty());
        assert_eq!(areas.bad_records(), 2);
    }

    #[test]
    fn the_programs_room_check_keeps_it_off_unread_bytes() {
        // Room for exactly what is left, not a byte more.
        assert!(area_has_room(AREA - 64, 0, 64));
        assert!(!area_has_room(AREA - 64, 0, 72));
        assert!(area_has_room(5 * AREA + 8, 4 * AREA + 16, 8));
        assert!(!area_has_room(5 * AREA + 8, 4 * AREA + 16, 16));
        // A consumer past the producer, or a producer more than an area
        // ahead, is full.
        assert!(!area_has_room(100, 108, 8));
        assert!(!area_has_room(AREA + 8, 0, 0));
        assert!(area_has_room(u64::MAX - 7, u64::MAX - 7, AREA));
    }

    #[test]
    fn record_spans_are_checked_against_the_area_and_the_producer() {
        // A record at the start, and one at the area's last offset, run
        // into the slack.
        assert_eq!(record_span(0, 128, 120), Ok((8..128, 128)));
        let last = AREA - 8;
        assert_eq!(
            record_span(3 * AREA + last, 3 * AREA + last + 1_008, 1_000),
            Ok((
                last as usize + 8..last as usize + 1_008,
                3 * AREA + last + 1_008
            ))
        );
        assert_eq!(record_span(0, 8, 0), Err(AreaError::TooShort { length: 0 }));
        assert_eq!(
            record_span(0, 64, 120),
            Err(AreaError::PastProducer {
                length: 120,
                unread: 64
            })
        );
        assert_eq!(
            record_span(last, last + 70_000, 69_000),
            Err(AreaError::PastEnd {
                length: 69_000,
                offset: last as usize
            })
        );
        assert_eq!(
            record_span(0, 8, u64::MAX),
            Err(AreaError::PastEnd {
                length: u64::MAX,
                offset: 0
            })
        );
        assert_eq!(
            record_span(10, 5, 100),
            Err(AreaError::ProducerAhead {
                unread: 5u64.wrapping_sub(10)
            })
        );
    }
}
