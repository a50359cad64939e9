//! Another process's memory, read with `process_vm_readv`: every read of
//! the JVM's structures goes through [`Memory`], so a test can hand the
//! readers bytes of its own.

use std::io;

use crate::JvmError;

/// Memory of the process whose structures are read.
pub trait Memory {
    /// Fills `buf` from `addr`; a short read is an error.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), JvmError>;

    fn u64_at(&self, addr: u64) -> Result<u64, JvmError> {
        let mut word = [0; 8];
        self.read(addr, &mut word)?;
        Ok(u64::from_le_bytes(word))
    }

    /// A NUL-terminated string of at most `max` bytes (longer ones are
    /// refused: HotSpot's names of types, fields and blobs are short).
    fn c_string(&self, addr: u64, max: usize) -> Result<String, JvmError> {
        let mut buf = vec![0; max];
        // A string near the end of a mapping: read what the page holds.
        let to_page_end = (0x1000 - (addr & 0xfff)) as usize;
        let first = max.min(to_page_end);
        self.read(addr, &mut buf[..first])?;
        let end = match buf[..first].iter().position(|&b| b == 0) {
            Some(end) => end,
            None if first < max => {
                self.read(addr.wrapping_add(first as u64), &mut buf[first..])?;
                buf.iter()
                    .position(|&b| b == 0)
                    .ok_or(JvmError::Malformed("a string without an end"))?
            }
            None => return Err(JvmError::Malformed("a string without an end")),
        };
        buf.truncate(end);
        String::from_utf8(buf).map_err(|_| JvmError::Malformed("a name that is not UTF-8"))
    }
}

/// A live process's memory.
#[derive(Debug, Clone, Copy)]
pub struct ProcessMemory {
    pub pid: u32,
}

impl Memory for ProcessMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), JvmError> {
        let len = buf.len();
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: len,
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len,
        };
        // SAFETY: one local iovec over `buf`, which we own; the remote
        // range is only read by the kernel, which checks it.
        let read = unsafe { libc::process_vm_readv(self.pid as i32, &local, 1, &remote, 1, 0) };
        match read {
            -1 => Err(JvmError::Read {
                addr,
                len,
                source: io::Error::last_os_error(),
            }),
            n if n as usize == len => Ok(()),
            _ => Err(JvmError::Read {
                addr,
                len,
                source: io::ErrorKind::UnexpectedEof.into(),
            }),
        }
    }
}
