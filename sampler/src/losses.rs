//! Records lost to full rings, read in place: the program counts them per
//! CPU in `RECORDS_LOST`, an array the kernel lets the agent map, and the
//! reader sums the slots before every drain without a system call.
//!
//! Owns the mapping; does not own what a loss means to the reader (the
//! agent rereads the processes' state).

use std::{
    io,
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
};

use aya::maps::MapData;

/// `RECORDS_LOST`, mapped read-only.
pub(crate) struct LostRecords {
    slots: NonNull<u64>,
    count: usize,
    mapped_bytes: usize,
    // The map the pages belong to (the mapping would keep it alive anyway).
    _map: MapData,
}

// SAFETY: the pointer is to shared memory mapped for this value alone, only
// read, and unmapped once, on drop.
unsafe impl Send for LostRecords {}
unsafe impl Sync for LostRecords {}

impl LostRecords {
    /// Maps the `count` slots of `map` (an array of `u64` created with
    /// `BPF_F_MMAPABLE`).
    pub(crate) fn map(map: MapData, count: usize) -> io::Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .map_err(|_| io::Error::other("no page size"))?;
        let mapped_bytes = (count.max(1) * size_of::<u64>()).next_multiple_of(page);
        let fd = map.fd().as_fd().as_raw_fd();
        // SAFETY: a new shared read-only mapping of the map's value area,
        // whose size the kernel checks against the map's.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped_bytes,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let slots = NonNull::new(address.cast::<u64>()).ok_or_else(|| io::Error::other("null"))?;
        Ok(Self {
            slots,
            count,
            mapped_bytes,
            _map: map,
        })
    }

    /// Records lost on every CPU since the program was loaded.
    pub(crate) fn total(&self) -> u64 {
        (0..self.count)
            .map(|slot| {
                // SAFETY: within the mapping, aligned; the program writes
                // it whole (an aligned u64 store), this only loads.
                unsafe { AtomicU64::from_ptr(self.slots.add(slot).as_ptr()) }
                    .load(Ordering::Relaxed)
            })
            .fold(0u64, u64::wrapping_add)
    }
}

impl Drop for LostRecords {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.slots.as_ptr().cast(), self.mapped_bytes) };
    }
}
