//! The record rings: one per CPU (one per group of CPUs on hosts too large
//! for that) and one for deep copies, shared by every CPU ([`RingLayout`]).
//! Made here, handed to the program through its `SAMPLE_RINGS` slots (the
//! deep ring's, then one per CPU), and read with the CPUs' sample areas
//! ([`crate::areas`], where ticks' direct records go) as one stream in
//! time order ([`Rings::drain`]).
//!
//! Why several: a ring shared by every CPU made each reservation take its
//! lock and write its producer position, lines the other CPUs' ticks wrote
//! too. Why in time order: a thread that blocks on one CPU and wakes on
//! another writes its off-CPU sample and its switch-in record to two
//! rings, and the reader applies exec, exit and mapping events in time
//! with the samples around them.

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    io,
    os::fd::{AsRawFd, FromRawFd as _, OwnedFd},
};

use agent_common::{
    DEEP_COPY_CLASSES, MAX_DEEP_STACK_BYTES, RecordKind, SampleArea, reserved_record_bytes,
};
use aya::maps::{ArrayOfMaps, Map, MapData, MapError, RingBuf, ring_buf::RingBufItem};
use aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_RINGBUF;
use tokio::io::unix::AsyncFd;

use crate::{areas::SampleAreas, mapping_feed::monotonic_ns, record::record_time};

/// A CPU's share of ring memory. At 997 Hz a CPU produces ~5.5 MB/s with
/// busy.c's adaptive copies, so a reader woken at a quarter full has
/// hundreds of milliseconds of slack; ~33 MB/s if every tick copied the
/// whole 32 KiB ceiling, which leaves it ~45 ms.
const BYTES_PER_CPU: usize = 2 << 20;

/// The least memory of the CPUs' rings on any host.
const MIN_TOTAL_BYTES: usize = 4 << 20;

/// The most memory of the CPUs' rings, and of the deep ring, on any host.
const MAX_TOTAL_BYTES: usize = 1 << 30;

/// Most sample areas on any host (a CPU past them writes its direct
/// records to its ring): 272 MiB of them.
const MAX_SAMPLE_AREAS: usize = 256;

/// CPUs per three of the largest deep copies in the deep ring. Deep copies
/// come from a few threads (a compiler's main thread, a deep program's
/// first ticks), and most are far smaller than the largest class (tens to
/// hundreds of KiB), so the ring holds many more of those.
const CPUS_PER_DEEP_ROOM: usize = 8;

/// How many rings and how large; every size a power of two, as the kernel
/// requires. The kernel maps a ring's pages twice into the agent, all of
/// them at once, so every MiB here is two of the agent's RSS (8 MiB of
/// ring was a quarter of its RSS at 997 Hz on 2 CPUs).
///
/// - The CPUs' rings: 2 MiB per CPU, at least 4 MiB in all, at most
///   [`MAX_TOTAL_BYTES`] (past it, CPUs share rings).
/// - The deep ring (none when deep copies are off): room for three of the
///   largest deep copies `deep_stack_bytes` allows (each reserves its
///   class's [`reserved_record_bytes`] plus the ring's 8-byte record
///   header) per [`CPUS_PER_DEEP_ROOM`] CPUs. With room for one, a deep
///   program's next tick found the ring still holding the last copy
///   whenever the reader lagged (under the test suite's load) and fell
///   back to a shorter copy that did not reach the root. With the default
///   2 MiB deep copies: 8 MiB up to 8 CPUs, 64 MiB for 64.
/// - A [`SampleArea`] per CPU, up to [`MAX_SAMPLE_AREAS`]: mapped once,
///   1.06 MiB each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingLayout {
    pub cpu_rings: u32,
    pub ring_bytes: u32,
    /// 0: no deep ring.
    pub deep_ring_bytes: u32,
    pub sample_areas: u32,
}

impl RingLayout {
    pub fn for_host(cpus: usize, deep_stack_bytes: u32) -> Self {
        let cpus = cpus.max(1);
        let total = cpus
            .saturating_mul(BYTES_PER_CPU)
            .max(MIN_TOTAL_BYTES)
            .next_power_of_two()
            .min(MAX_TOTAL_BYTES);
        let rings = (total / BYTES_PER_CPU).clamp(1, cpus);
        let share = total / rings;
        // The largest power of two within the ring's share.
        let ring_bytes = 1 << (usize::BITS - 1 - share.leading_zeros());
        let deep_ring_bytes = if deep_stack_bytes == 0 {
            0
        } else {
            let deep_class = DEEP_COPY_CLASSES
                .into_iter()
                .find(|&class| class >= deep_stack_bytes)
                .unwrap_or(MAX_DEEP_STACK_BYTES);
            let deep_record = reserved_record_bytes(deep_class, true) as usize + 8;
            (3 * deep_record)
                .saturating_mul(cpus.div_ceil(CPUS_PER_DEEP_ROOM))
                .next_power_of_two()
                .min(MAX_TOTAL_BYTES)
        };
        Self {
            cpu_rings: rings as u32,
            ring_bytes: ring_bytes as u32,
            deep_ring_bytes: deep_ring_bytes as u32,
            sample_areas: cpus.min(MAX_SAMPLE_AREAS) as u32,
        }
    }

    pub fn rings(&self) -> u32 {
        self.cpu_rings + u32::from(self.deep_ring_bytes != 0)
    }

    /// The rings' bytes (each mapped twice).
    pub fn total_bytes(&self) -> u64 {
        u64::from(self.cpu_rings) * u64::from(self.ring_bytes) + u64::from(self.deep_ring_bytes)
    }

    /// The sample areas' bytes (mapped once).
    pub fn area_bytes(&self) -> u64 {
        u64::from(self.sample_areas) * size_of::<SampleArea>() as u64
    }

    /// The ring of the CPU in `cpu`'s slot.
    fn ring_of(&self, cpu: u32) -> u32 {
        cpu % self.cpu_rings
    }
}

/// The rings and areas the program writes, and what the reader needs to
/// read them.
pub struct Rings {
    rings: Vec<RingBuf<MapData>>,
    areas: SampleAreas,
    /// `SAMPLE_RINGS`, held open: programs loaded after the rings were made
    /// resolve their reference to it through this descriptor.
    _slots: ArrayOfMaps<MapData, RingBuf<MapData>>,
    /// An epoll instance watching every ring: readable when one is.
    ready: AsyncFd<OwnedFd>,
    /// What [`Self::drain`] orders the rings by ([`Queues`]), kept for
    /// their allocations.
    oldest: BinaryHeap<Reverse<(u64, usize)>>,
    empty: BinaryHeap<Reverse<(u64, usize)>>,
    due: Vec<usize>,
}

impl Rings {
    /// Creates the rings of `layout` and fills the slots of `slots` (the
    /// deep ring's, then one per CPU) with them, and maps `areas` (the
    /// program's `SAMPLE_AREAS`, of `layout.sample_areas` areas). Must be
    /// called inside a tokio runtime.
    pub fn create(
        layout: RingLayout,
        mut slots: ArrayOfMaps<MapData, RingBuf<MapData>>,
        areas: MapData,
    ) -> Result<Self, RingsError> {
        let areas =
            SampleAreas::map(areas, layout.sample_areas as usize).map_err(RingsError::MapAreas)?;
        let mut rings = (0..layout.cpu_rings)
            .map(|_| create_ring("SAMPLES", layout.ring_bytes))
            .collect::<Result<Vec<_>, _>>()
            .map_err(RingsError::Create)?;
        for slot in 1..slots.len() {
            let ring = &rings[layout.ring_of(slot - 1) as usize];
            slots.set(slot, ring, 0).map_err(RingsError::Slot)?;
        }
        if layout.deep_ring_bytes != 0 {
            let deep =
                create_ring("DEEP_SAMPLES", layout.deep_ring_bytes).map_err(RingsError::Create)?;
            slots.set(0, &deep, 0).map_err(RingsError::Slot)?;
            // Last: of records with the same time the merge passes the
            // lower ring's first, and a tick's Python stack (in its CPU's
            // ring) must come before its deep sample, which takes it as
            // its CPU's pending stack.
            rings.push(deep);
        }
        let ready = watch_readable(&rings).map_err(RingsError::Poll)?;
        Ok(Self {
            oldest: BinaryHeap::with_capacity(rings.len() + areas.len()),
            empty: BinaryHeap::with_capacity(rings.len() + areas.len()),
            due: Vec::with_capacity(rings.len() + areas.len()),
            rings,
            areas,
            _slots: slots,
            ready,
        })
    }

    /// Records found bad in the sample areas so far (see
    /// [`crate::areas::AreaError`]).
    pub fn bad_area_records(&self) -> u64 {
        self.areas.bad_records()
    }

    /// Waits until a ring has records. Cancel safe. Readiness is cleared
    /// before the drain that follows: a record written after this point
    /// wakes the next wait.
    pub async fn readable(&mut self) -> io::Result<()> {
        self.ready.readable_mut().await?.clear_ready();
        Ok(())
    }

    /// Passes every queued record to `on_record`, oldest first across the
    /// rings and areas (the sources), and returns how many there were.
    ///
    /// Each source's oldest unread record is held until it is the oldest
    /// of all. A source found empty may be written again while the others
    /// are read (a blocked thread's switch-in on one CPU, its off-CPU
    /// sample read from another): it is read again before a record whose
    /// time is past the moment it was found empty is passed on. What stays
    /// unordered is a record whose time was taken before that moment and
    /// that was committed after (within one run of the program:
    /// microseconds), and, in a ring that CPUs share, records reserved in
    /// another order than their times were taken: as when one ring served
    /// every CPU. Records of the same time are passed in the order of their
    /// sources: the rings (see [`Self::create`]), then the areas (a tick
    /// that writes to an area writes no other record).
    pub fn drain(&mut self, mut on_record: impl FnMut(&[u8])) -> usize {
        // Holding a record of every ring at once needs a borrow of each,
        // which the vector's borrow cannot give out one at a time.
        let mut sources = Sources {
            rings: self.rings.iter_mut().map(std::ptr::from_mut).collect(),
            areas: &mut self.areas,
        };
        // Local, so no record outlives this call or its source.
        let mut heads: Vec<Option<Head<'_>>> = (0..sources.len()).map(|_| None).collect();
        let mut queues = Queues {
            oldest: &mut self.oldest,
            empty: &mut self.empty,
            due: &mut self.due,
        };
        queues.oldest.clear();
        queues.empty.clear();
        let now = monotonic_ns();
        for index in 0..sources.len() {
            // SAFETY: `heads` cannot outlive the sources; no record is
            // taken yet.
            unsafe { queues.read_next(&mut sources, index, now, &mut heads) };
        }
        let mut count = 0;
        // The head whose time the empty sources were last read again for:
        // at most once per head, so a record stamped in the future (a bad
        // one) cannot keep the reader re-reading them.
        let mut read_again_for = None;
        while let Some(&Reverse(head)) = queues.oldest.peek() {
            let (time, index) = head;
            if read_again_for != Some(head) {
                read_again_for = Some(head);
                // SAFETY: as above.
                if unsafe { queues.read_again(&mut sources, time, &mut heads) } {
                    continue;
                }
            }
            queues.oldest.pop();
            if let Some(record) = heads[index].take() {
                on_record(record.bytes());
                count += 1;
                sources.consumed(index, record);
            }
            // SAFETY: as above; the source's record was passed on and let go.
            unsafe { queues.read_next(&mut sources, index, monotonic_ns(), &mut heads) };
        }
        count
    }
}

/// What [`Rings::drain`] reads, by index: the rings, then the areas.
struct Sources<'a> {
    rings: Vec<*mut RingBuf<MapData>>,
    areas: &'a mut SampleAreas,
}

/// A source's record, held until it is passed on.
enum Head<'s> {
    Ring(RingBufItem<'s>),
    Area(&'s [u8]),
}

impl Head<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Ring(record) => record,
            Self::Area(record) => record,
        }
    }
}

impl Sources<'_> {
    fn len(&self) -> usize {
        self.rings.len() + self.areas.len()
    }

    /// Source `index`'s next record. A ring's [`agent_common::Doorbell`]s
    /// are let go of on the way: they only woke the reader.
    ///
    /// # Safety
    /// The record must not outlive its source, and source `index` has no
    /// record taken.
    unsafe fn next<'s>(&mut self, index: usize) -> Option<Head<'s>> {
        match self.rings.get(index) {
            Some(&ring) => loop {
                // SAFETY: the caller's; a doorbell is dropped before the
                // next record is taken.
                let record = unsafe { (*ring).next() }?;
                if !is_doorbell(&record) {
                    break Some(Head::Ring(record));
                }
            },
            // SAFETY: the caller's.
            None => unsafe { self.areas.next(index - self.rings.len()) }.map(Head::Area),
        }
    }

    /// Lets go of source `index`'s record `head`, passed on: the program
    /// may write over it.
    fn consumed(&mut self, index: usize, head: Head<'_>) {
        match head {
            Head::Ring(record) => drop(record),
            Head::Area(_) => self.areas.consume(index - self.rings.len()),
        }
    }
}

fn is_doorbell(record: &[u8]) -> bool {
    record.first_chunk::<4>() == Some(&(RecordKind::Doorbell as u32).to_ne_bytes())
}

/// What [`Rings::drain`] orders the sources by.
struct Queues<'q> {
    /// Each source's held record, by its time.
    oldest: &'q mut BinaryHeap<Reverse<(u64, usize)>>,
    /// The sources found empty, by when.
    empty: &'q mut BinaryHeap<Reverse<(u64, usize)>>,
    /// Sources to read again (kept for its allocation).
    due: &'q mut Vec<usize>,
}

impl Queues<'_> {
    /// Takes the next record of source `index` into `heads[index]`, queued
    /// by its time, or queues the source as found empty at `before`, a
    /// time taken before the look (a record stamped between the two would
    /// otherwise pass unseen).
    ///
    /// # Safety
    /// `heads` does not outlive `sources`, and holds no record of source
    /// `index`.
    unsafe fn read_next<'s>(
        &mut self,
        sources: &mut Sources<'_>,
        index: usize,
        before: u64,
        heads: &mut [Option<Head<'s>>],
    ) {
        debug_assert!(heads[index].is_none(), "source {index} read twice");
        // SAFETY: the caller's.
        let head = unsafe { sources.next(index) };
        match &head {
            Some(record) => self
                .oldest
                .push(Reverse((record_time(record.bytes()), index))),
            None => self.empty.push(Reverse((before, index))),
        }
        heads[index] = head;
    }

    /// Reads again every source found empty at or before `time` (with one
    /// look at the clock for all), and says whether one had a record.
    ///
    /// # Safety
    /// As [`Self::read_next`]'s, for every source found empty.
    unsafe fn read_again<'s>(
        &mut self,
        sources: &mut Sources<'_>,
        time: u64,
        heads: &mut [Option<Head<'s>>],
    ) -> bool {
        while let Some(&Reverse((found_empty, index))) = self.empty.peek()
            && found_empty <= time
        {
            self.empty.pop();
            self.due.push(index);
        }
        if self.due.is_empty() {
            return false;
        }
        let before = monotonic_ns();
        let held = self.oldest.len();
        for due in 0..self.due.len() {
            let index = self.due[due];
            // SAFETY: the caller's; a source found empty has no record taken.
            unsafe { self.read_next(sources, index, before, heads) };
        }
        self.due.clear();
        self.oldest.len() > held
    }
}

fn create_ring(name: &str, bytes: u32) -> Result<RingBuf<MapData>, MapError> {
    let map = aya_obj::Map::new_from_params(BPF_MAP_TYPE_RINGBUF as u32, 0, 0, bytes, 0);
    RingBuf::try_from(Map::from_map_data(MapData::create(map, name, None)?)?)
}

/// An epoll instance with every ring's descriptor in it, registered with
/// the tokio reactor: readable while a ring has unread records (a ring's
/// descriptor polls readable from the wake-up the program sends).
fn watch_readable(rings: &[RingBuf<MapData>]) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: plain syscall; the descriptor is owned from here on.
    let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if epoll < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
    for (index, ring) in rings.iter().enumerate() {
        let mut event = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: index as u64,
        };
        // SAFETY: both descriptors are open; `event` outlives the call.
        let added = unsafe {
            libc::epoll_ctl(
                epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                ring.as_raw_fd(),
                &mut event,
            )
        };
        if added < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    // SAFETY: an `OwnedFd` returns the descriptor it owns, the same one
    // for its whole lifetime.
    unsafe { AsyncFd::register_with_interest(epoll, tokio::io::Interest::READABLE) }
        .map_err(|err| err.into_parts().1)
}

#[derive(Debug, thiserror::Error)]
pub enum RingsError {
    #[error("creating a record ring failed")]
    Create(#[source] MapError),
    #[error("giving a CPU its record ring failed")]
    Slot(#[source] MapError),
    #[error("registering the record rings with the async runtime failed")]
    Poll(#[source] io::Error),
    #[error("BPF map SAMPLE_AREAS could not be mapped into memory")]
    MapAreas(#[source] io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u32 = 1 << 20;

    fn layout(cpu_rings: u32, ring_mib: u32, deep_mib: u32) -> RingLayout {
        RingLayout {
            cpu_rings,
            ring_bytes: ring_mib * MIB,
            deep_ring_bytes: deep_mib * MIB,
            sample_areas: cpu_rings,
        }
    }

    #[test]
    fn each_cpu_gets_a_ring_of_its_own_while_memory_allows() {
        assert_eq!(RingLayout::for_host(1, 0), layout(1, 4, 0));
        assert_eq!(RingLayout::for_host(2, 0), layout(2, 2, 0));
        // 3 CPUs may use 8 MiB; 3 rings of 2 MiB fit, a fourth would not.
        assert_eq!(RingLayout::for_host(3, 0), layout(3, 2, 0));
        assert_eq!(RingLayout::for_host(64, 0), layout(64, 2, 0));
        // Deep copies leave the CPUs' rings as they are.
        assert_eq!(
            RingLayout::for_host(2, MAX_DEEP_STACK_BYTES),
            layout(2, 2, 8)
        );
        assert_eq!(RingLayout::for_host(2, MAX_DEEP_STACK_BYTES).rings(), 3);
        assert_eq!(RingLayout::for_host(2, 0).rings(), 2);
    }

    #[test]
    fn the_deep_ring_holds_three_of_the_largest_deep_copies_per_eight_cpus() {
        let deep_ring = |cpus, deep| RingLayout::for_host(cpus, deep).deep_ring_bytes / MIB;
        // Three copies of 512 KiB (and their headers) need 2 MiB, of 1 MiB
        // 4 MiB, of more than 1 MiB 8 MiB.
        assert_eq!(deep_ring(2, 512 << 10), 2);
        assert_eq!(deep_ring(2, MIB), 4);
        assert_eq!(deep_ring(2, MIB + 8), 8);
        assert_eq!(deep_ring(1, MAX_DEEP_STACK_BYTES), 8);
        assert_eq!(deep_ring(8, MAX_DEEP_STACK_BYTES), 8);
        assert_eq!(deep_ring(9, MAX_DEEP_STACK_BYTES), 16);
        assert_eq!(deep_ring(64, MAX_DEEP_STACK_BYTES), 64);
    }

    #[test]
    fn ring_memory_is_bounded_on_any_host() {
        let huge = RingLayout::for_host(100_000, MAX_DEEP_STACK_BYTES);
        assert_eq!(
            huge,
            RingLayout {
                sample_areas: 256,
                ..layout(512, 2, 1024)
            }
        );
        assert_eq!(huge.total_bytes(), 2 << 30);
        assert_eq!(huge.area_bytes(), 272 << 20);
        assert_eq!(huge.ring_of(100_000 - 1), (100_000 - 1) % 512);
    }
}
