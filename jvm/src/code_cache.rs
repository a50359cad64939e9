//! HotSpot's code cache: its heaps, which blob holds an address (through
//! each heap's segment map, as `CodeHeap::find_start` does), and what the
//! blob says of its frames.
//!
//! A heap is split into segments (64 or 128 bytes); its segment map holds
//! a byte per segment: 0 where a block starts, else how many segments to
//! go back towards the start (chained for blocks longer than 254
//! segments), 0xFF for free segments.

use std::{ops::Range, sync::Arc};

use crate::{
    JvmError,
    layout::{CodeRange, InterpreterLayout, Layout, VerifiedEntry},
    memory::Memory,
};

/// Heaps read at most (JDK 17 has three: non-nmethods, profiled and
/// non-profiled nmethods).
const MAX_HEAPS: u64 = 16;

/// Segment-map bytes read at once when going back to a block's start.
const SEGMAP_WINDOW: u64 = 512;

/// Segments gone back at most: a blob longer than this many segments (4
/// MiB of 64-byte segments) is not found rather than looked for forever.
const MAX_SEGMENTS_BACK: u64 = 1 << 16;

/// The segment map's mark of a free segment.
const FREE_SEGMENT: u8 = 0xff;

/// One code heap: the committed part of its memory and its segment map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeHeap {
    /// Segments start here (`_memory._low`).
    pub low: u64,
    /// The committed end (`_memory._high`).
    pub high: u64,
    pub segmap: u64,
    pub log2_segment_size: u32,
}

impl CodeHeap {
    pub fn contains(&self, pc: u64) -> bool {
        (self.low..self.high).contains(&pc)
    }
}

/// Reads the heaps `CodeCache::_heaps` lists.
pub fn read_heaps(memory: &impl Memory, layout: &Layout) -> Result<Vec<CodeHeap>, JvmError> {
    let array = memory.u64_at(layout.heaps)?;
    let mut len = [0; 4];
    memory.read(array.wrapping_add(layout.array_len), &mut len)?;
    let len = u64::from(u32::from_le_bytes(len));
    if len > MAX_HEAPS {
        return Err(JvmError::Malformed("more code heaps than HotSpot makes"));
    }
    let data = memory.u64_at(array.wrapping_add(layout.array_data))?;
    let mut heaps = Vec::with_capacity(len as usize);
    for i in 0..len {
        let heap = memory.u64_at(data.wrapping_add(i * 8))?;
        let space = |field: u64| memory.u64_at(heap.wrapping_add(layout.heap_memory + field));
        let mut log2 = [0; 4];
        memory.read(heap.wrapping_add(layout.heap_log2_segment_size), &mut log2)?;
        let log2_segment_size = u32::from_le_bytes(log2);
        if !(4..=16).contains(&log2_segment_size) {
            return Err(JvmError::Malformed("a code heap's segment size"));
        }
        let (low, high) = (space(layout.space_low)?, space(layout.space_high)?);
        if high < low {
            return Err(JvmError::Malformed("a code heap's bounds"));
        }
        heaps.push(CodeHeap {
            low,
            high,
            segmap: memory.u64_at(heap.wrapping_add(layout.heap_segmap + layout.space_low))?,
            log2_segment_size,
        });
    }
    Ok(heaps)
}

/// What kind of code a blob holds, as far as stepping out of its frames
/// goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlobKind {
    /// A compiled Java method (C1 or C2).
    Nmethod,
    /// A native method's compiled wrapper (`native nmethod`).
    NativeNmethod,
    /// The template interpreter: its frames are linked by rbp.
    Interpreter,
    /// Any other stub or adapter.
    Stub,
}

/// One code blob, as read when it was looked up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeBlob {
    pub start: u64,
    /// `start + _size`.
    pub end: u64,
    pub kind: BlobKind,
    /// The frame's size in bytes, return address and saved rbp included
    /// (0: the blob makes no frame of its own, or says nothing of it).
    pub frame_bytes: u32,
    /// From here on, the frame is built (`_frame_complete_offset`);
    /// `None` where the blob says it never is at an instruction a sample
    /// can trust (-1: runtime stubs that save registers as they go).
    pub frame_complete: Option<u64>,
    pub code: Range<u64>,
    /// Where an nmethod's verified entry is: before it, its inline cache
    /// check has pushed nothing.
    pub verified_entry: Option<u64>,
    /// Where an nmethod's stubs begin (exception, deoptimization and poll
    /// handlers, run with the frame torn down or a return address pushed).
    pub stubs: Option<u64>,
    /// An nmethod's `Method*` (0 for other blobs).
    pub method: u64,
    /// An nmethod's compile id: with the method, tells a blob from the one
    /// that reused its memory.
    pub compile_id: i32,
    /// Where an nmethod's debug information is, when the layout says.
    pub debug: Option<DebugSections>,
    /// HotSpot's name for the blob (`nmethod`, `Interpreter`, `StubRoutines
    /// (1)`, ...).
    pub name: Arc<str>,
}

/// An nmethod's `PcDesc`s, scope records and metadata (JDK 9-19).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DebugSections {
    pub pcs: Range<u64>,
    pub data: Range<u64>,
    pub metadata: Range<u64>,
}

/// The start of the blob holding `pc` in `heap`, or `None` where the
/// segment is free.
pub fn blob_start(
    memory: &impl Memory,
    layout: &Layout,
    heap: &CodeHeap,
    pc: u64,
) -> Result<Option<u64>, JvmError> {
    let mut segment = pc
        .checked_sub(heap.low)
        .ok_or(JvmError::Malformed("an address below its heap"))?
        >> heap.log2_segment_size;
    let mut window: Vec<u8> = Vec::new();
    let mut window_start = u64::MAX;
    let mut gone_back = 0;
    loop {
        if segment < window_start || segment >= window_start + window.len() as u64 {
            window_start = segment.saturating_sub(SEGMAP_WINDOW - 1);
            window.resize((segment - window_start + 1) as usize, 0);
            memory.read(heap.segmap.wrapping_add(window_start), &mut window)?;
        }
        let hop = window[(segment - window_start) as usize];
        if hop == FREE_SEGMENT {
            return Ok(None);
        }
        if hop == 0 {
            break;
        }
        gone_back += u64::from(hop);
        if gone_back > MAX_SEGMENTS_BACK || u64::from(hop) > segment {
            return Err(JvmError::Malformed("a segment map that leads nowhere"));
        }
        segment -= u64::from(hop);
    }
    let block = heap.low.wrapping_add(segment << heap.log2_segment_size);
    if let Some(used) = layout.block_used {
        let mut flag = [0];
        memory.read(block.wrapping_add(used), &mut flag)?;
        if flag[0] == 0 {
            return Ok(None);
        }
    }
    Ok(Some(block.wrapping_add(layout.heap_block_size)))
}

/// Reads the blob at `start` (see [`blob_start`]).
pub fn read_blob(memory: &impl Memory, layout: &Layout, start: u64) -> Result<CodeBlob, JvmError> {
    let header = read_header(memory, layout, start)?;
    let u64_at = |at: u64| {
        u64::from_le_bytes(
            header[at as usize..][..8]
                .try_into()
                .expect("checked by Layout"),
        )
    };
    let i32_at = |at: u64| {
        i32::from_le_bytes(
            header[at as usize..][..4]
                .try_into()
                .expect("checked by Layout"),
        )
    };
    let size = i32_at(layout.blob_size);
    let frame_words = i32_at(layout.blob_frame_size);
    let (at, narrow) = layout.blob_frame_complete;
    let frame_complete = if narrow {
        i32::from(i16::from_le_bytes(
            header[at as usize..][..2]
                .try_into()
                .expect("checked by Layout"),
        ))
    } else {
        i32_at(at)
    };
    let frame_bytes = u32::try_from(frame_words)
        .ok()
        .filter(|&words| words <= 1 << 20)
        .ok_or(JvmError::Malformed("a code blob's frame size"))?
        * 8;
    let within = |offset: i32| {
        u64::try_from(offset)
            .ok()
            .and_then(|offset| start.checked_add(offset))
    };
    let end = within(size)
        .filter(|&end| end > start)
        .ok_or(JvmError::Malformed("a code blob's size"))?;
    let code = match layout.blob_code {
        CodeRange::Pointers { begin, end } => u64_at(begin)..u64_at(end),
        CodeRange::Offsets { code, data } => {
            let offset = |at| within(i32_at(at)).ok_or(JvmError::Malformed("a code blob's code"));
            offset(code)?..offset(data)?
        }
    };
    if code.start < start || code.end > end || code.start > code.end {
        return Err(JvmError::Malformed("a code blob's code outside the blob"));
    }
    let name = memory.c_string(u64_at(layout.blob_name), 128)?;
    let is_nmethod = match layout.blob_kind {
        Some((at, nmethod)) => header[at as usize] == nmethod,
        None => name == "nmethod" || name == "native nmethod",
    };
    let kind = match &*name {
        "native nmethod" if is_nmethod => BlobKind::NativeNmethod,
        _ if is_nmethod => BlobKind::Nmethod,
        "Interpreter" => BlobKind::Interpreter,
        _ => BlobKind::Stub,
    };
    let frame_complete = u64::try_from(frame_complete)
        .ok()
        .and_then(|offset| code.start.checked_add(offset))
        .filter(|&at| at <= end);
    let nmethod = matches!(kind, BlobKind::Nmethod | BlobKind::NativeNmethod);
    let stubs = layout
        .nmethod_stub_offset
        .filter(|_| nmethod)
        .and_then(|at| within(i32_at(at)))
        .filter(|&at| at > code.start && at <= end);
    let verified_entry = match layout.nmethod_verified_entry.filter(|_| nmethod) {
        Some(VerifiedEntry::Pointer(at)) => Some(u64_at(at)),
        Some(VerifiedEntry::Offset(at)) => {
            let offset = u16::from_le_bytes(
                header[at as usize..][..2]
                    .try_into()
                    .expect("checked by Layout"),
            );
            code.start.checked_add(u64::from(offset))
        }
        None => None,
    }
    .filter(|&at| at >= code.start && at <= frame_complete.unwrap_or(code.start));
    let debug = match (nmethod, &layout.scopes) {
        (true, Some(scopes)) => {
            let offset =
                |at| within(i32_at(at)).ok_or(JvmError::Malformed("an nmethod's debug sections"));
            let pcs = offset(scopes.pcs_offset)?..offset(scopes.pcs_end_offset)?;
            let data = u64_at(scopes.data_begin)..pcs.start;
            let metadata = offset(scopes.metadata_offset)?..data.start;
            let sections = DebugSections {
                pcs,
                data,
                metadata,
            };
            let inside = |range: &Range<u64>| {
                range.start <= range.end && range.start >= start && range.end <= end
            };
            if ![&sections.pcs, &sections.data, &sections.metadata]
                .into_iter()
                .all(inside)
            {
                return Err(JvmError::Malformed("an nmethod's debug sections"));
            }
            Some(sections)
        }
        _ => None,
    };
    let (method, compile_id) = if nmethod {
        (
            u64_at(layout.nmethod_method),
            i32_at(layout.nmethod_compile_id),
        )
    } else {
        (0, 0)
    };
    Ok(CodeBlob {
        start,
        end,
        kind,
        frame_bytes,
        frame_complete,
        code,
        verified_entry,
        stubs,
        method,
        compile_id,
        debug,
        name: name.into(),
    })
}

/// The first `Layout::blob_header_bytes` at `start`.
fn read_header(memory: &impl Memory, layout: &Layout, start: u64) -> Result<Vec<u8>, JvmError> {
    let mut header = vec![0; layout.blob_header_bytes as usize];
    memory.read(start, &mut header)?;
    Ok(header)
}

/// Codelets read at most (JDK 17's interpreter has 271).
const MAX_CODELETS: usize = 2048;

/// The template interpreter's codelets in which rbp is the running
/// frame's pointer at every instruction: the bytecodes' templates but the
/// returns' (which tear the frame down with `leave`). Method entries (before
/// `enter`), return, exception and deoptimization entries are left out.
/// `None` until the interpreter has been generated.
pub fn interpreter_templates(
    memory: &impl Memory,
    layout: &InterpreterLayout,
) -> Option<Vec<Range<u64>>> {
    let queue = memory
        .u64_at(layout.code)
        .ok()
        .filter(|&queue| queue != 0)?;
    let int_at = |at: u64| {
        let mut bytes = [0; 4];
        memory
            .read(at, &mut bytes)
            .ok()
            .map(|()| i32::from_le_bytes(bytes))
    };
    let buffer = memory.u64_at(queue.wrapping_add(layout.stub_buffer)).ok()?;
    let begin = u64::try_from(int_at(queue.wrapping_add(layout.queue_begin))?).ok()?;
    let end = u64::try_from(int_at(queue.wrapping_add(layout.queue_end))?).ok()?;
    let (mut at, end) = (buffer.checked_add(begin)?, buffer.checked_add(end)?);
    let mut templates = Vec::new();
    for _ in 0..MAX_CODELETS {
        if at >= end {
            // A generated interpreter has hundreds of codelets.
            return (templates.len() >= 100).then_some(templates);
        }
        let size = u64::try_from(int_at(at.wrapping_add(layout.codelet_size))?)
            .ok()
            .filter(|&size| size > 0)?;
        let bytecode = int_at(at.wrapping_add(layout.codelet_bytecode))?;
        if bytecode >= 0 {
            let description = memory
                .u64_at(at.wrapping_add(layout.codelet_description))
                .ok()
                .and_then(|name| memory.c_string(name, 64).ok())?;
            let tears_down =
                description.ends_with("return") || description == "return_register_finalizer";
            if !tears_down {
                templates.push(at..at.checked_add(size)?);
            }
        }
        at = at.checked_add(size)?;
    }
    None
}

/// Whether the nmethod `blob` is still at its start: its compile id and
/// method read again (a blob freed and its memory reused holds another's,
/// or code).
pub fn still_there(memory: &impl Memory, layout: &Layout, blob: &CodeBlob) -> bool {
    let (method_at, id_at) = (layout.nmethod_method, layout.nmethod_compile_id);
    let from = method_at.min(id_at);
    let mut bytes = vec![0; (method_at.max(id_at) + 8 - from) as usize];
    if memory
        .read(blob.start.wrapping_add(from), &mut bytes)
        .is_err()
    {
        return false;
    }
    let method = u64::from_le_bytes(
        bytes[(method_at - from) as usize..][..8]
            .try_into()
            .expect("sized above"),
    );
    let id = i32::from_le_bytes(
        bytes[(id_at - from) as usize..][..4]
            .try_into()
            .expect("sized above"),
    );
    method == blob.method && id == blob.compile_id
}
