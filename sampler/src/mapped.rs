//! A BPF array's values mapped into the agent (an array created with
//! `BPF_F_MMAPABLE`), for reading and writing in place; in tests, values
//! on the heap instead. Owns the mapping and its unmapping, not what the
//! values mean (`stack_tops` and `areas` say that).

use std::{
    io,
    marker::PhantomData,
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
};

use aya::maps::MapData;

/// `count` values of type `T`, contiguous.
pub(crate) struct MappedValues<T> {
    values: NonNull<T>,
    backing: Backing<T>,
}

enum Backing<T> {
    Mapped {
        bytes: usize,
        _values: PhantomData<T>,
        // The map the pages belong to (the mapping would keep it alive
        // anyway).
        _map: MapData,
    },
    /// Values leaked from a box and freed on drop.
    #[cfg(test)]
    Heap(NonNull<[T]>),
}

// SAFETY: the pointer is to memory mapped (or allocated) for this value
// alone, and unmapped (or freed) once, on drop. What its owners share
// with the program they read and write with atomics or volatile access.
unsafe impl<T: Send> Send for MappedValues<T> {}
unsafe impl<T: Sync> Sync for MappedValues<T> {}

impl<T> MappedValues<T> {
    /// Maps the first `count` values of `map`, whose values are `T`s.
    pub(crate) fn map(map: MapData, count: usize) -> io::Result<Self> {
        // The kernel lays values out 8 bytes apart at least: a `T` of a
        // multiple of 8 lies where the program wrote it.
        const { assert!(size_of::<T>().is_multiple_of(8)) };
        let bytes = count * size_of::<T>();
        let fd = map.fd().as_fd().as_raw_fd();
        // SAFETY: a new shared mapping of the map's value area, whose size
        // the kernel checks against the map's.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let values = NonNull::new(address.cast()).ok_or_else(|| io::Error::other("null"))?;
        Ok(Self {
            values,
            backing: Backing::Mapped {
                bytes,
                _values: PhantomData,
                _map: map,
            },
        })
    }

    /// `values`, on the heap, for tests.
    #[cfg(test)]
    pub(crate) fn in_memory(values: Box<[T]>) -> Self {
        let values = NonNull::from(Box::leak(values));
        Self {
            values: values.cast(),
            backing: Backing::Heap(values),
        }
    }

    /// The first value; the others follow it.
    pub(crate) fn as_ptr(&self) -> *mut T {
        self.values.as_ptr()
    }
}

impl<T> Drop for MappedValues<T> {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: the mapping made in `map`, unmapped once.
            Backing::Mapped { bytes, .. } => unsafe {
                libc::munmap(self.values.as_ptr().cast(), bytes);
            },
            // SAFETY: the box `in_memory` leaked, freed once.
            #[cfg(test)]
            Backing::Heap(values) => drop(unsafe { Box::from_raw(values.as_ptr()) }),
        }
    }
}
