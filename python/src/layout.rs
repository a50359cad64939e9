//! Where CPython keeps what the sampler follows, per minor version: the
//! thread-state key in `_PyRuntime`, the frame chain, the code object and
//! its strings. Measured on this machine's CPython 3.10.13, 3.11.7, 3.12.1
//! and 3.13.0 (and Debian's 3.11.2), see `docs/research/cpython-frames.md`,
//! and on Debian sid's 3.14.10; stable within a minor version (3.13+
//! publish them themselves, in `_Py_DebugOffsets`, checked against these).

use agent_common::PythonProcess;

use crate::{DebugOffsets, Interpreter};

/// glibc's thread-specific data: key `k` (< 32) is at `fs_base + 0x310 +
/// 16 * k + 8` (`specific_1stblock[k].data` in `struct pthread`), the same
/// in every glibc since 2.34 on x86-64.
const GLIBC_TSD_BASE: u32 = 0x310 + 8;
const GLIBC_TSD_STRIDE: u32 = 16;

/// The offsets of one CPython minor version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub version: (u8, u8),
    /// `Py_tss_t autoTSSkey` in `_PyRuntime`.
    runtime_tss_key: u32,
    tstate_frame: u32,
    cframe_frame: u32,
    frame_code: u32,
    frame_previous: u32,
    frame_instr: u32,
    frame_entry: u32,
    entry_value: u32,
    entry_is_shim: bool,
    /// 3.10's frame objects (see `PythonProcess::frame_objects`).
    frame_objects: bool,
    /// The frame's `owner` byte (unused for 3.10's frame objects).
    frame_owner: u32,
    /// Bytes of a frame that hold every field above.
    frame_bytes: u32,
    /// In a code object (3.10 has no `co_qualname`: `co_name` stands in,
    /// and its bytecode is another object: `code_bytecode` is where the
    /// fields read end).
    pub code_first_line: u32,
    pub code_bytecode: u32,
    pub code_filename: u32,
    pub code_qualname: u32,
    pub code_linetable: u32,
    /// How a code object states the size of its frames (3.11+), checked
    /// against a [`agent_common::PythonFrame::FRAME_SIZE`] fingerprint.
    pub code_frame_size: CodeFrameSize,
    pub line_table: LineTable,
    /// Where a compact ASCII string's characters start (`sizeof
    /// PyASCIIObject`), and a compact non-ASCII one's.
    pub ascii_data: u32,
    pub compact_data: u32,
}

/// How a code object states the size, in 8-byte words, of the frames
/// that run it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeFrameSize {
    /// 3.10: frames are objects of their own, never fingerprinted by size.
    None,
    /// 3.11: `co_nlocalsplus + co_stacksize` slots after the frame's 9
    /// words of fixed fields (`FRAME_SPECIALS_SIZE`).
    Slots { nlocalsplus: u32, stacksize: u32 },
    /// 3.12+: `co_framesize`.
    Field(u32),
}

/// 3.11's `FRAME_SPECIALS_SIZE`: `(sizeof(_PyInterpreterFrame) - 1) / 8`.
pub const FRAME_SPECIALS_WORDS_3_11: u32 = 9;

/// How a code object maps instructions to lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineTable {
    /// 3.10's `co_linetable` (PEP 626): pairs of (bytes of bytecode, line
    /// delta), -128 for no line.
    Pep626,
    /// 3.11+'s location table (`Objects/locations.md`).
    Locations,
}

/// 3.10: frame objects, `tstate->frame` then `f_back`; every frame has its
/// own evaluation loop activation; `f_lasti` counts code units.
const V3_10: Layout = Layout {
    version: (3, 10),
    runtime_tss_key: 0x248,
    tstate_frame: 24,
    cframe_frame: PythonProcess::NO_CFRAME,
    frame_code: 32,
    frame_previous: 24,
    frame_instr: 96,
    frame_entry: 0,
    entry_value: 0,
    entry_is_shim: false,
    frame_objects: true,
    frame_owner: 0,
    frame_bytes: 104,
    code_first_line: 40,
    code_bytecode: 128,
    code_filename: 104,
    code_qualname: 112,
    code_linetable: 120,
    code_frame_size: CodeFrameSize::None,
    line_table: LineTable::Pep626,
    ascii_data: 48,
    compact_data: 72,
};

/// 3.11: `tstate->cframe->current_frame`, `is_entry` marks an entry.
const V3_11: Layout = Layout {
    version: (3, 11),
    runtime_tss_key: 0x250,
    tstate_frame: 56,
    cframe_frame: 8,
    frame_code: 32,
    frame_previous: 48,
    frame_instr: 56,
    frame_entry: 68,
    entry_value: 1,
    entry_is_shim: false,
    frame_objects: false,
    frame_owner: 69,
    frame_bytes: 72,
    code_first_line: 72,
    code_bytecode: 184,
    code_filename: 112,
    code_qualname: 128,
    code_linetable: 136,
    code_frame_size: CodeFrameSize::Slots {
        nlocalsplus: 76,
        stacksize: 68,
    },
    line_table: LineTable::Locations,
    ascii_data: 48,
    compact_data: 72,
};

/// 3.12: the frame's fields move, a shim frame (`owner == 3`) marks an
/// entry, strings lose `wstr`.
const V3_12: Layout = Layout {
    version: (3, 12),
    runtime_tss_key: 0x608,
    cframe_frame: 0,
    frame_code: 0,
    frame_previous: 8,
    frame_entry: 70,
    entry_value: 3,
    entry_is_shim: true,
    frame_owner: 70,
    code_first_line: 68,
    code_frame_size: CodeFrameSize::Field(76),
    code_bytecode: 192,
    ascii_data: 40,
    compact_data: 56,
    ..V3_11
};

/// 3.13: no `_PyCFrame`, the thread state points at the frame.
const V3_13: Layout = Layout {
    version: (3, 13),
    runtime_tss_key: 0x870,
    tstate_frame: 72,
    cframe_frame: PythonProcess::NO_CFRAME,
    code_bytecode: 200,
    ..V3_12
};

/// 3.14: the frame's code object is a tagged `_PyStackRef` (the sampler
/// masks its low bits whatever the version: an object is 8-aligned), its
/// `owner` moves after a new field, and the entry frame's owner is
/// `FRAME_OWNED_BY_INTERPRETER`, still 3; the thread-state key moves in
/// `_PyRuntime` (where `PyGILState_GetThisThreadState` reads it), the
/// bytecode in the code object.
const V3_14: Layout = Layout {
    version: (3, 14),
    runtime_tss_key: 0x920,
    frame_entry: 74,
    frame_owner: 74,
    frame_bytes: 80,
    code_bytecode: 208,
    ..V3_13
};

impl Layout {
    /// The layout of CPython `major.minor`, if this profiler reads it.
    pub fn of(version: (u8, u8)) -> Option<Self> {
        match version {
            (3, 10) => Some(V3_10),
            (3, 11) => Some(V3_11),
            (3, 12) => Some(V3_12),
            (3, 13) => Some(V3_13),
            (3, 14) => Some(V3_14),
            _ => None,
        }
    }

    /// The layout of `interpreter`'s version, if this profiler reads it.
    pub fn of_interpreter(interpreter: &Interpreter) -> Option<Self> {
        Self::of(interpreter.version())
    }

    /// The first field whose offset `published` (the interpreter's
    /// `_Py_DebugOffsets`) states otherwise than this layout: its name,
    /// the published offset and this layout's. None when they agree.
    pub fn disagreement(&self, published: &DebugOffsets) -> Option<(&'static str, u64, u32)> {
        [
            (
                "thread state current_frame",
                published.tstate_current_frame,
                self.tstate_frame,
            ),
            (
                "frame previous",
                published.frame_previous,
                self.frame_previous,
            ),
            (
                "frame executable",
                published.frame_executable,
                self.frame_code,
            ),
            (
                "frame instr_ptr",
                published.frame_instr_ptr,
                self.frame_instr,
            ),
            ("frame owner", published.frame_owner, self.frame_owner),
            (
                "code co_filename",
                published.code_filename,
                self.code_filename,
            ),
            (
                "code co_qualname",
                published.code_qualname,
                self.code_qualname,
            ),
            (
                "code co_linetable",
                published.code_linetable,
                self.code_linetable,
            ),
            (
                "code co_firstlineno",
                published.code_firstlineno,
                self.code_first_line,
            ),
            (
                "code co_code_adaptive",
                published.code_bytecode,
                self.code_bytecode,
            ),
        ]
        .into_iter()
        .find(|(_, published, known)| *published != u64::from(*known))
    }

    /// What the sampler needs to walk the frames of a process (started at
    /// `process_start_ns`) whose `_PyRuntime` lies at `runtime`.
    pub fn sampler_entry(&self, runtime: u64, process_start_ns: u64) -> PythonProcess {
        PythonProcess {
            process_start_ns,
            tss_key: runtime + u64::from(self.runtime_tss_key),
            tsd_base: GLIBC_TSD_BASE,
            tsd_stride: GLIBC_TSD_STRIDE,
            tstate_frame: self.tstate_frame,
            cframe_frame: self.cframe_frame,
            frame_code: self.frame_code,
            frame_previous: self.frame_previous,
            frame_instr: self.frame_instr,
            frame_entry: self.frame_entry,
            entry_value: self.entry_value,
            entry_is_shim: u32::from(self.entry_is_shim),
            code_first_line: self.code_first_line,
            code_bytecode: self.code_bytecode,
            frame_objects: u32::from(self.frame_objects),
            frame_bytes: self.frame_bytes,
            frame_owner: self.frame_owner,
            frame_sizes: u32::from(self.code_frame_size != CodeFrameSize::None),
        }
    }
}

#[cfg(test)]
mod tests {
    use agent_common::PYTHON_FRAME_READ_BYTES;

    use super::*;

    #[test]
    fn every_frame_field_lies_within_the_bytes_the_sampler_reads() {
        for minor in 10..=14 {
            let layout = Layout::of((3, minor)).expect("a known version");
            assert!(layout.frame_bytes <= PYTHON_FRAME_READ_BYTES);
            for (field, size) in [
                (layout.frame_code, 8),
                (layout.frame_previous, 8),
                (layout.frame_instr, 8),
                (layout.frame_entry, 1),
                (layout.frame_owner, 1),
            ] {
                assert!(field + size <= layout.frame_bytes, "3.{minor}: {field}");
            }
            // The code object's fields read lie within what is read of it.
            let frame_size_fields = match layout.code_frame_size {
                CodeFrameSize::None => vec![],
                CodeFrameSize::Slots {
                    nlocalsplus,
                    stacksize,
                } => vec![nlocalsplus + 4, stacksize + 4],
                CodeFrameSize::Field(offset) => vec![offset + 4],
            };
            for field in [
                layout.code_first_line + 4,
                layout.code_filename + 8,
                layout.code_qualname + 8,
                layout.code_linetable + 8,
            ]
            .into_iter()
            .chain(frame_size_fields)
            {
                assert!(field <= layout.code_bytecode, "3.{minor}: {field}");
            }
        }
        assert_eq!(Layout::of((3, 9)), None);
        assert_eq!(Layout::of((3, 15)), None);
    }

    /// The interpreters on this machine: 3.13 publishes offsets that agree
    /// with its layout, every field; the older ones publish none. Those
    /// not installed are skipped, and said so.
    #[test]
    fn cpython_3_13_publishes_the_offsets_its_layout_states() {
        let libraries = [
            ("3.10.13", "libpython3.10.so.1.0", false),
            ("3.11.7", "libpython3.11.so.1.0", false),
            ("3.12.1", "libpython3.12.so.1.0", false),
            ("3.13.0", "libpython3.13.so.1.0", true),
        ];
        for (version, library, publishes) in libraries {
            let path = format!("/root/.pyenv/versions/{version}/lib/{library}");
            let Ok(file) = std::fs::File::open(&path) else {
                eprintln!("{path} is not installed: skipped");
                continue;
            };
            let interpreter = Interpreter::read(&file, std::path::Path::new(&path))
                .expect("an ELF file")
                .expect("an interpreter");
            assert_eq!(interpreter.debug_offsets.is_some(), publishes, "{path}");
            let layout = Layout::of_interpreter(&interpreter).expect("a known version");
            if let Some(published) = interpreter.debug_offsets {
                assert_eq!(layout.disagreement(&published), None, "{path}");
                // One field moved: named, with both offsets.
                let moved = DebugOffsets {
                    code_qualname: published.code_qualname + 8,
                    ..published
                };
                assert_eq!(
                    layout.disagreement(&moved),
                    Some((
                        "code co_qualname",
                        u64::from(layout.code_qualname) + 8,
                        layout.code_qualname
                    ))
                );
            }
        }
    }
}
