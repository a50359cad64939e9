//! Where the running kernel keeps a task's thread group leader and start
//! time in `struct task_struct`, read from the kernel's BTF. The sampler
//! passes both offsets to the BPF program, which then stamps every sample
//! with its process's start time: with the pid, the process's identity.
//!
//! Owns only finding the two offsets; the BPF program does the reads.

use std::path::Path;

use btfparse::{Offset, Readable, TypeInformation};

/// The kernel's own BTF.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// Byte offsets in `struct task_struct`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskLayout {
    /// `group_leader`: a pointer to the thread group leader's task.
    pub group_leader: u32,
    /// `start_time`: when the task started, monotonic nanoseconds.
    pub start_time: u32,
}

/// Why the layout could not be found.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("reading {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing the kernel's BTF: {0:?}")]
    Parse(btfparse::Error),
    #[error("the kernel's BTF has no struct task_struct")]
    NoTaskStruct,
    #[error("task_struct.{0} is missing or not byte-aligned")]
    Member(&'static str),
}

struct Bytes(Vec<u8>);

impl Readable for Bytes {
    fn read(&self, offset: u64, buffer: &mut [u8]) -> btfparse::Result<()> {
        let source = usize::try_from(offset)
            .ok()
            .and_then(|start| self.0.get(start..)?.get(..buffer.len()))
            .ok_or_else(|| {
                btfparse::Error::new(btfparse::ErrorKind::IOError, "read past the end of the BTF")
            })?;
        buffer.copy_from_slice(source);
        Ok(())
    }
}

impl TaskLayout {
    /// The layout of the running kernel, from [`VMLINUX_BTF`].
    pub fn of_running_kernel() -> Result<Self, LayoutError> {
        Self::from_btf_file(Path::new(VMLINUX_BTF))
    }

    pub fn from_btf_file(path: &Path) -> Result<Self, LayoutError> {
        let bytes = std::fs::read(path).map_err(|source| LayoutError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let types = TypeInformation::new(&Bytes(bytes)).map_err(LayoutError::Parse)?;
        let task = types
            .id_of("task_struct")
            .ok_or(LayoutError::NoTaskStruct)?;
        let offset = |member: &'static str| match types.offset_of(task, member) {
            Ok((_, Offset::ByteOffset(offset))) => Ok(offset),
            _ => Err(LayoutError::Member(member)),
        };
        Ok(Self {
            group_leader: offset("group_leader")?,
            start_time: offset("start_time")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_running_kernels_task_layout() {
        let layout = TaskLayout::of_running_kernel().expect("this kernel has BTF");
        // Both members sit well inside task_struct, 8-aligned, and apart.
        assert!(layout.group_leader > 0 && layout.group_leader.is_multiple_of(8));
        assert!(layout.start_time > 0 && layout.start_time.is_multiple_of(8));
        assert_ne!(layout.group_leader, layout.start_time);
    }

    #[test]
    fn a_file_that_is_not_btf_is_a_clear_error() {
        let file = tempfile::NamedTempFile::new().expect("a temporary file");
        std::fs::write(file.path(), b"not BTF at all").expect("writing it");
        assert!(matches!(
            TaskLayout::from_btf_file(file.path()),
            Err(LayoutError::Parse(_))
        ));
        assert!(matches!(
            TaskLayout::from_btf_file(Path::new("/nonexistent/btf")),
            Err(LayoutError::Read { .. })
        ));
    }
}
