//! Every `unsafe` of the crate: the `perf_event_open` syscall, mapping the
//! ring buffer, and the `data_head`/`data_tail` protocol with the kernel.
//!
//! Owns: [`perf_event_open`] and [`Ring`], a mapped perf ring buffer that
//! hands out the published bytes as plain slices and gives them back.
//!
//! Does not own: which attr to open ([`attr`](crate::attr)), record framing
//! ([`walk`](crate::walk)) or decoding ([`record`](crate::record)).
//!
//! The ring protocol (`include/uapi/linux/perf_event.h`, "ring buffer"): the
//! kernel writes records into the data area (the pages after the first,
//! metadata page) and publishes them by storing `data_head` with release
//! semantics; the reader loads `data_head` with acquire, reads the bytes
//! from its `data_tail` up to the head, and gives them back by storing
//! `data_tail` with release so that its reads finish before the kernel may
//! overwrite them. The mapping is writable, which is what tells the kernel
//! to respect `data_tail` (and count a LOST record when the ring is full)
//! rather than overwrite unread records.
#![allow(unsafe_code)]

use std::{
    io,
    os::fd::{AsFd, BorrowedFd, FromRawFd as _, OwnedFd},
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
};

use crate::{
    attr::{PERF_FLAG_FD_CLOEXEC, PerfEventAttr},
    walk::{Walk, walk_records},
};

/// Offset of `data_head` in `struct perf_event_mmap_page` (after the 1 KiB
/// of fields and reserved space that precede it; checked with `offsetof`).
const DATA_HEAD_OFFSET: usize = 1024;
/// Offset of `data_tail`.
const DATA_TAIL_OFFSET: usize = 1032;

/// The size of a page, which the ring buffer is made of.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .unwrap_or(4096)
}

/// Opens a system-wide event for `cpu` (pid -1: every process on that CPU),
/// with `O_CLOEXEC`.
pub(crate) fn perf_event_open(attr: &PerfEventAttr, cpu: u32) -> io::Result<OwnedFd> {
    // The kernel writes the size it supports back into `size` on E2BIG, so
    // it gets a copy it may scribble on.
    let mut attr = *attr;
    let cpu = libc::c_int::try_from(cpu).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `attr` is a live, initialized `perf_event_attr` whose `size`
    // field is its true size, valid for reads and writes during the call;
    // the other arguments are plain integers.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &raw mut attr,
            -1 as libc::pid_t,
            cpu,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = libc::c_int::try_from(ret).map_err(|_| io::Error::other("fd out of range"))?;
    // SAFETY: the syscall returned a new file descriptor that nothing else
    // owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One CPU's mapped ring buffer: a metadata page followed by a data area of
/// a power-of-two number of pages.
pub(crate) struct Ring {
    /// Start of the mapping (the metadata page). Page-aligned.
    base: NonNull<u8>,
    /// Length of the whole mapping.
    map_len: usize,
    /// Offset of the data area in the mapping (one page).
    data_offset: usize,
    /// Size of the data area, a power of two.
    data_size: usize,
    /// The event. It closes after [`Drop::drop`] has unmapped the ring
    /// (fields drop after it).
    fd: OwnedFd,
}

// SAFETY: a `Ring` owns its mapping exclusively (nothing else in the process
// has the pointer) and reading it needs `&mut self`, so moving it to another
// thread is as safe as moving a `Vec`.
unsafe impl Send for Ring {}

impl Ring {
    /// Maps the ring of the event `fd`: 1 + `data_pages` pages, read-write.
    pub(crate) fn map(fd: OwnedFd, page_size: usize, data_pages: usize) -> io::Result<Self> {
        let data_size = data_pages
            .checked_mul(page_size)
            .filter(|s| s.is_power_of_two())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let map_len = data_size
            .checked_add(page_size)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a fresh shared mapping of the event's fd; no existing
        // memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(Self {
            base,
            map_len,
            data_offset: page_size,
            data_size,
            fd,
        })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The `u64` at `offset` in the metadata page, as the atomic the kernel
    /// treats it as.
    fn meta_u64(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: `offset` is DATA_HEAD_OFFSET or DATA_TAIL_OFFSET, inside
        // the first page of the mapping, which lives as long as `self`; the
        // page is page-aligned so the field is 8-byte aligned; the kernel
        // accesses it only atomically (READ_ONCE/smp_store_release), so
        // treating it as an `AtomicU64` races with nothing non-atomic.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(offset).cast::<u64>()) }
    }

    /// Hands every record published since the last call to `on_record`,
    /// then gives the space back to the kernel.
    ///
    /// When the head is more than a ring ahead of the tail (which the
    /// kernel does not do while `data_tail` is respected) nothing is read:
    /// everything up to the head is discarded, as for a bad header.
    pub(crate) fn read(&mut self, scratch: &mut Vec<u8>, on_record: impl FnMut(&[u8])) -> Walk {
        let head = self.meta_u64(DATA_HEAD_OFFSET).load(Ordering::Acquire);
        // Only this reader writes data_tail.
        let tail = self.meta_u64(DATA_TAIL_OFFSET).load(Ordering::Relaxed);
        let available = head.wrapping_sub(tail);
        let walk = if available > self.data_size as u64 {
            Walk {
                discarded: Some(available),
                ..Walk::default()
            }
        } else {
            // Both fit in usize: available <= data_size, and the offset is
            // reduced modulo data_size (a power of two).
            let available = available as usize;
            let start = (tail & (self.data_size as u64 - 1)) as usize;
            let first_len = available.min(self.data_size - start);
            let second_len = available - first_len;
            // SAFETY: both ranges lie inside the data area
            // (start + first_len <= data_size, second_len < data_size) of a
            // mapping that lives as long as `self`. They cover exactly the
            // bytes from tail to head, which the kernel published before its
            // release store of data_head (our acquire load orders the reads
            // after it) and will not write again until we move data_tail
            // past them, which happens only after the slices are dropped, at
            // the end of this function.
            let (first, second) = unsafe {
                let data = self.base.as_ptr().add(self.data_offset);
                (
                    std::slice::from_raw_parts(data.add(start), first_len),
                    std::slice::from_raw_parts(data, second_len),
                )
            };
            walk_records(first, second, scratch, on_record)
        };
        // Every byte up to the head is consumed, read or discarded. Release:
        // the reads above must finish before the kernel reuses the space.
        self.meta_u64(DATA_TAIL_OFFSET)
            .store(head, Ordering::Release);
        walk
    }

    /// Size of the data area in bytes.
    pub(crate) fn data_size(&self) -> usize {
        self.data_size
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: `base`/`map_len` are exactly the mapping made in `map`,
        // and no slice into it outlives `read`, so nothing refers to it.
        // munmap can only fail on invalid arguments, which these are not.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.map_len);
        }
        // `fd` closes after this, as the struct's fields drop.
    }
}
