//! HotSpot's code cache: its heaps, which blob holds an address (through
//! each heap's segment map, as `CodeHeap::find_start` does), and what the
//! blob says of its frames.
//!
//! A heap is split into segments (64 or 128 bytes); its segment map holds
//! a byte per segment: 0 where a block starts, else how many segments to
//! go back towards the start (chained for blocks longer than 254
//! segments), 0xFF for free segments.

use crate::{
    JvmError,
    layout::{CodeRange, Layout},
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
    memory.read(array + layout.array_len, &mut len)?;
    let len = u64::from(u32::from_le_bytes(len));
    if len > MAX_HEAPS {
        return Err(JvmError::Malformed("more code heaps than HotSpot makes"));
    }
    let data = memory.u64_at(array + layout.array_data)?;
    let mut heaps = Vec::with_capacity(len as usize);
    for i in 0..len {
        let heap = memory.u64_at(data + i * 8)?;
        let space = |field: u64| memory.u64_at(heap + layout.heap_memory + field);
        let mut log2 = [0; 4];
        memory.read(heap + layout.heap_log2_segment_size, &mut log2)?;
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
            segmap: memory.u64_at(heap + layout.heap_segmap + layout.space_low)?,
            log2_segment_size,
        });
    }
    Ok(heaps)
}

/// What kind of code a blob holds, as far as stepping out of its frames
/// goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlobKind {
    /// A compiled Java method (C1, C2, or a native method's wrapper).
    Nmethod,
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
    pub frame_bytes: u64,
    /// From here on, the frame is built (`_frame_complete_offset`;
    /// `start` when the blob does not say).
    pub frame_complete: u64,
    pub code: std::ops::Range<u64>,
    /// An nmethod's `Method*` (0 for other blobs).
    pub method: u64,
    /// An nmethod's compile id: with the method, tells a blob from the one
    /// that reused its memory.
    pub compile_id: i32,
    pub name: String,
}

/// The start of the blob holding `pc` in `heap`, or `None` where the
/// segment is free.
pub fn blob_start(
    memory: &impl Memory,
    layout: &Layout,
    heap: &CodeHeap,
    pc: u64,
) -> Result<Option<u64>, JvmError> {
    let mut segment = (pc - heap.low) >> heap.log2_segment_size;
    let mut window: Vec<u8> = Vec::new();
    let mut window_start = u64::MAX;
    let mut gone_back = 0;
    loop {
        if segment < window_start || segment >= window_start + window.len() as u64 {
            window_start = segment.saturating_sub(SEGMAP_WINDOW - 1);
            window.resize((segment - window_start + 1) as usize, 0);
            memory.read(heap.segmap + window_start, &mut window)?;
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
    let block = heap.low + (segment << heap.log2_segment_size);
    if let Some(used) = layout.block_used {
        let mut flag = [0];
        memory.read(block + used, &mut flag)?;
        if flag[0] == 0 {
            return Ok(None);
        }
    }
    Ok(Some(block + layout.heap_block_size))
}

/// Reads the blob at `start` (see [`blob_start`]).
pub fn read_blob(memory: &impl Memory, layout: &Layout, start: u64) -> Result<CodeBlob, JvmError> {
    let mut header = vec![0; layout.blob_header_bytes as usize];
    memory.read(start, &mut header)?;
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
    if size <= 0 || !(0..=(1 << 20)).contains(&frame_words) {
        return Err(JvmError::Malformed("a code blob's size"));
    }
    let end = start + size as u64;
    let code = match layout.blob_code {
        CodeRange::Pointers { begin, end } => u64_at(begin)..u64_at(end),
        CodeRange::Offsets { code, data } => {
            start + i32_at(code).max(0) as u64..start + i32_at(data).max(0) as u64
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
    let kind = if is_nmethod {
        BlobKind::Nmethod
    } else if name == "Interpreter" {
        BlobKind::Interpreter
    } else {
        BlobKind::Stub
    };
    let (method, compile_id) = match kind {
        BlobKind::Nmethod => (
            u64_at(layout.nmethod_method),
            i32_at(layout.nmethod_compile_id),
        ),
        _ => (0, 0),
    };
    Ok(CodeBlob {
        start,
        end,
        kind,
        frame_bytes: frame_words as u64 * 8,
        frame_complete: if frame_complete > 0 {
            code.start + frame_complete as u64
        } else {
            start
        },
        code,
        method,
        compile_id,
        name,
    })
}
