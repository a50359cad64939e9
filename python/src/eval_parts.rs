//! Where the evaluation loop's code lies when a compiler split it.
//!
//! The symbol `_PyEval_EvalFrameDefault` covers only the part of the
//! function that holds its entry. GCC's hot/cold partitioning moves the
//! rest to a part named only in the full symbol table
//! (`_PyEval_EvalFrameDefault.cold`), which a stripped build drops: in
//! Debian's CPython 3.14.10 the symbol spans 1,184 bytes and the loop
//! runs in an 84 KB part with no name at all, so no native frame of a
//! sample fell in the symbol and no Python frame found its place.
//!
//! A part is found from the function's own code: each direct jump out of
//! it (`jmp rel32`, `jcc rel32`) to the first address of an `.eh_frame`
//! FDE whose rules at that address are not a function's entry (the CFA is
//! not yet `rsp + 8`: the part continues a frame the function set up) is
//! a part of it. A tail call to another function lands where the CFA is
//! `rsp + 8`, and is not taken.

use std::ops::Range;

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, LittleEndian, UnwindContext, UnwindSection as _,
    X86_64,
};

/// The `.eh_frame_hdr` and `.eh_frame` sections, with their addresses.
pub struct CallFrameSections<'a> {
    pub hdr: &'a [u8],
    pub hdr_address: u64,
    pub eh_frame: &'a [u8],
    pub eh_frame_address: u64,
}

/// Most jump targets looked up, and most bytes of code scanned for them
/// (a whole unsplit loop is 50-200 KB): past these, the code is not what
/// the scan expects and nothing more is looked at.
const MAX_TARGETS: usize = 4096;
const MAX_CODE_BYTES: u64 = 4 << 20;

/// The parts of the function `symbol` that lie outside it, found through
/// `sections`' FDEs, each part's own jumps scanned in turn (a part can be
/// split again); `read` gives the code at an address range. Empty when
/// there are none (or the sections cannot be read).
pub fn split_parts(
    symbol: Range<u64>,
    read: impl Fn(&Range<u64>) -> Option<Vec<u8>>,
    sections: &CallFrameSections,
) -> Vec<Range<u64>> {
    let bases = BaseAddresses::default()
        .set_eh_frame_hdr(sections.hdr_address)
        .set_eh_frame(sections.eh_frame_address);
    // The header's binary search table finds each target's FDE without
    // parsing the others (a libpython has about 10,000).
    let Ok(hdr) = EhFrameHdr::new(sections.hdr, LittleEndian).parse(&bases, 8) else {
        return Vec::new();
    };
    let Some(table) = hdr.table() else {
        return Vec::new();
    };
    let eh_frame = EhFrame::new(sections.eh_frame, LittleEndian);
    let mut context: UnwindContext<usize> = UnwindContext::new();
    let mut parts: Vec<Range<u64>> = Vec::new();
    let mut to_scan = vec![symbol.clone()];
    let (mut scanned, mut looked_up) = (0u64, 0usize);
    while let Some(code) = to_scan.pop() {
        scanned += code.end - code.start;
        if scanned > MAX_CODE_BYTES {
            break;
        }
        let Some(bytes) = read(&code) else {
            continue;
        };
        let mut targets: Vec<u64> = jump_targets(&bytes, code.start)
            .filter(|target| {
                !symbol.contains(target) && !parts.iter().any(|part| part.contains(target))
            })
            .collect();
        targets.sort_unstable();
        targets.dedup();
        for target in targets {
            looked_up += 1;
            if looked_up > MAX_TARGETS {
                break;
            }
            let Ok(fde) =
                table.fde_for_address(&eh_frame, &bases, target, EhFrame::cie_from_offset)
            else {
                continue;
            };
            if fde.initial_address() != target || parts.iter().any(|part| part.contains(&target)) {
                continue;
            }
            let Ok(row) = fde.unwind_info_for_address(&eh_frame, &bases, &mut context, target)
            else {
                continue;
            };
            let at_entry = matches!(
                row.cfa(),
                CfaRule::RegisterAndOffset { register, offset }
                    if *register == X86_64::RSP && *offset == 8
            );
            if !at_entry {
                let part = target..target.saturating_add(fde.len());
                parts.push(part.clone());
                to_scan.push(part);
            }
        }
    }
    parts.sort_unstable_by_key(|part| part.start);
    parts
}

/// The targets of the `jmp rel32` (`e9`) and `jcc rel32` (`0f 80`-`0f
/// 8f`) encodings at every byte of `code`. Not a disassembly: bytes inside
/// another instruction can look like a jump, which is why a target counts
/// only where an FDE of a split part starts.
fn jump_targets(code: &[u8], start: u64) -> impl Iterator<Item = u64> + '_ {
    (0..code.len()).filter_map(move |at| {
        let (opcode_len, rel) = match code[at..] {
            [0xe9, a, b, c, d, ..] => (1, [a, b, c, d]),
            [0x0f, 0x80..=0x8f, a, b, c, d, ..] => (2, [a, b, c, d]),
            _ => return None,
        };
        let next = start.checked_add((at + opcode_len + 4) as u64)?;
        Some(next.wrapping_add_signed(i64::from(i32::from_le_bytes(rel))))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_jumps_are_read_at_every_byte_and_calls_are_not() {
        // jmp +0x10; jne -0x20; call +0x40 (not a jump); a short jmp.
        let code = [
            0xe9, 0x10, 0, 0, 0, // 0x1000: jmp 0x1015
            0x0f, 0x85, 0xe0, 0xff, 0xff, 0xff, // 0x1005: jne 0xfeb
            0xe8, 0x40, 0, 0, 0, // 0x100b: call
            0xeb, 0x02, // 0x1010: jmp short
        ];
        let targets: Vec<u64> = jump_targets(&code, 0x1000).collect();
        assert_eq!(targets, vec![0x1015, 0xfeb]);
    }

    #[test]
    fn without_call_frame_information_nothing_is_a_part() {
        let code = [0xe9, 0x00, 0x10, 0, 0];
        let sections = CallFrameSections {
            hdr: &[],
            hdr_address: 0,
            eh_frame: &[],
            eh_frame_address: 0,
        };
        assert!(split_parts(0x1000..0x1005, |_| Some(code.to_vec()), &sections).is_empty());
    }
}
