//! Table compiler tests on hand-built CFI: sections written with
//! `gimli::write` for every rule kind, and raw bytes where the writer cannot
//! produce the input (`set_loc`, unknown opcodes, malformed headers).

use gimli::write::{
    Address, CallFrameInstruction as I, CommonInformationEntry, DebugFrame, EhFrame, EndianVec,
    Expression, FrameDescriptionEntry, FrameTable,
};
use gimli::{Encoding, Format, LittleEndian, X86_64};

use super::{CfiSection, TableError, UnsupportedCfi, UnwindRule, UnwindTable};

use UnwindRule::{Outermost, Plt, Rbp, RbpRbpSaved, Rsp, RspRbpSaved, SignalFrame, Unsupported};

const ENCODING: Encoding = Encoding {
    format: Format::Dwarf32,
    version: 1,
    address_size: 8,
};

/// The CIE GCC writes for every x86_64 function: cfa = rsp + 8, ra at cfa - 8.
fn standard_cie() -> CommonInformationEntry {
    let mut cie = CommonInformationEntry::new(ENCODING, 1, -8, X86_64::RA);
    cie.add_instruction(I::Cfa(X86_64::RSP, 8));
    cie.add_instruction(I::Offset(X86_64::RA, -8));
    cie
}

fn fde(start: u64, length: u32, instructions: &[(u32, I)]) -> FrameDescriptionEntry {
    let mut fde = FrameDescriptionEntry::new(Address::Constant(start), length);
    for (offset, instruction) in instructions {
        fde.add_instruction(*offset, instruction.clone());
    }
    fde
}

fn frame_table(cie: CommonInformationEntry, fdes: Vec<FrameDescriptionEntry>) -> FrameTable {
    let mut table = FrameTable::default();
    let cie = table.add_cie(cie);
    for fde in fdes {
        table.add_fde(cie, fde);
    }
    table
}

fn eh_frame_bytes(cie: CommonInformationEntry, fdes: Vec<FrameDescriptionEntry>) -> Vec<u8> {
    let mut section = EhFrame(EndianVec::new(LittleEndian));
    frame_table(cie, fdes)
        .write_eh_frame(&mut section)
        .expect("writing .eh_frame");
    section.0.take()
}

fn compile(cie: CommonInformationEntry, fdes: Vec<FrameDescriptionEntry>) -> UnwindTable {
    // Absolute FDE addresses: the section address does not matter.
    UnwindTable::from_eh_frame(&eh_frame_bytes(cie, fdes), 0x10_0000).expect("compiling")
}

fn rows(table: &UnwindTable) -> Vec<(u64, Option<UnwindRule>)> {
    table.rows().collect()
}

fn plt_expression(threshold: u8) -> Expression {
    use gimli::constants as c;
    Expression::raw(vec![
        c::DW_OP_breg7.0,
        8,
        c::DW_OP_breg16.0,
        0,
        c::DW_OP_lit15.0,
        c::DW_OP_and.0,
        c::DW_OP_lit0.0 + threshold,
        c::DW_OP_ge.0,
        c::DW_OP_lit3.0,
        c::DW_OP_shl.0,
        c::DW_OP_plus.0,
    ])
}

#[test]
fn push_rbp_mov_rsp_rbp_function() {
    // push %rbp; mov %rsp,%rbp; ...; pop %rbp; ret
    let table = compile(
        standard_cie(),
        vec![fde(
            0x1000,
            0x40,
            &[
                (1, I::CfaOffset(16)),
                (1, I::Offset(X86_64::RBP, -16)),
                (4, I::CfaRegister(X86_64::RBP)),
                (0x30, I::Cfa(X86_64::RSP, 8)),
                (0x30, I::Restore(X86_64::RBP)),
            ],
        )],
    );
    assert_eq!(
        rows(&table),
        [
            (0x1000, Some(Rsp { cfa_off: 8 })),
            (
                0x1001,
                Some(RspRbpSaved {
                    cfa_off: 16,
                    rbp_off: -16
                })
            ),
            (
                0x1004,
                Some(RbpRbpSaved {
                    cfa_off: 16,
                    rbp_off: -16
                })
            ),
            (0x1030, Some(Rsp { cfa_off: 8 })),
            (0x1040, None),
        ]
    );
    assert_eq!(table.lookup(0x0fff), None);
    assert_eq!(table.lookup(0x1003), table.lookup(0x1001));
    assert_eq!(table.lookup(0x103f), Some(Rsp { cfa_off: 8 }));
    assert_eq!(table.lookup(0x1040), None);
}

#[test]
fn cfa_rbp_without_saved_rbp() {
    let table = compile(
        standard_cie(),
        vec![fde(0x1000, 0x10, &[(2, I::Cfa(X86_64::RBP, 24))])],
    );
    assert_eq!(
        rows(&table),
        [
            (0x1000, Some(Rsp { cfa_off: 8 })),
            (0x1002, Some(Rbp { cfa_off: 24 })),
            (0x1010, None),
        ]
    );
}

#[test]
fn remember_and_restore_state_around_a_mid_function_return() {
    let table = compile(
        standard_cie(),
        vec![fde(
            0x2000,
            0x21,
            &[
                (1, I::CfaOffset(16)),
                (0x10, I::RememberState),
                (0x10, I::CfaOffset(8)),
                (0x11, I::RestoreState),
                (0x20, I::CfaOffset(8)),
            ],
        )],
    );
    assert_eq!(
        rows(&table),
        [
            (0x2000, Some(Rsp { cfa_off: 8 })),
            (0x2001, Some(Rsp { cfa_off: 16 })),
            (0x2010, Some(Rsp { cfa_off: 8 })),
            (0x2011, Some(Rsp { cfa_off: 16 })),
            (0x2020, Some(Rsp { cfa_off: 8 })),
            (0x2021, None),
        ]
    );
}

#[test]
fn every_advance_loc_form() {
    // Deltas of 0x30, 0x80, 0x1000 and 0x20000 need DW_CFA_advance_loc,
    // advance_loc1, advance_loc2 and advance_loc4 respectively.
    let offsets = [0x30u32, 0xb0, 0x10b0, 0x210b0];
    let instructions: Vec<(u32, I)> = offsets
        .iter()
        .enumerate()
        .map(|(i, &offset)| (offset, I::CfaOffset(16 + 8 * i as i32)))
        .collect();
    let bytes = eh_frame_bytes(standard_cie(), vec![fde(0x10_0000, 0x30000, &instructions)]);
    let contains = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    assert!(contains(&[0x40 | 0x30, 0x0e, 16]), "advance_loc");
    assert!(contains(&[0x02, 0x80, 0x0e, 24]), "advance_loc1");
    assert!(contains(&[0x03, 0x00, 0x10, 0x0e, 32]), "advance_loc2");
    assert!(
        contains(&[0x04, 0x00, 0x00, 0x02, 0x00, 0x0e, 40]),
        "advance_loc4"
    );

    let table = UnwindTable::from_eh_frame(&bytes, 0).expect("compiling");
    assert_eq!(
        rows(&table),
        [
            (0x10_0000, Some(Rsp { cfa_off: 8 })),
            (0x10_0030, Some(Rsp { cfa_off: 16 })),
            (0x10_00b0, Some(Rsp { cfa_off: 24 })),
            (0x10_10b0, Some(Rsp { cfa_off: 32 })),
            (0x12_10b0, Some(Rsp { cfa_off: 40 })),
            (0x13_0000, None),
        ]
    );
}

#[test]
fn gnu_args_size_does_not_split_rows() {
    let table = compile(
        standard_cie(),
        vec![fde(
            0x1000,
            0x20,
            &[
                (4, I::CfaOffset(32)),
                (8, I::ArgsSize(16)),
                (12, I::ArgsSize(0)),
            ],
        )],
    );
    assert_eq!(
        rows(&table),
        [
            (0x1000, Some(Rsp { cfa_off: 8 })),
            (0x1004, Some(Rsp { cfa_off: 32 })),
            (0x1020, None),
        ]
    );
}

#[test]
fn identical_consecutive_rows_merge() {
    let table = compile(
        standard_cie(),
        vec![fde(
            0x1000,
            0x20,
            &[
                (4, I::CfaOffset(16)),
                (8, I::CfaOffset(16)),
                (12, I::SameValue(X86_64::RBP)),
                (16, I::Offset(X86_64::RBX, -24)),
            ],
        )],
    );
    assert_eq!(
        rows(&table),
        [
            (0x1000, Some(Rsp { cfa_off: 8 })),
            (0x1004, Some(Rsp { cfa_off: 16 })),
            (0x1020, None),
        ]
    );
    assert_eq!(table.rule_count(), 2);
}

#[test]
fn plt_expressions() {
    // binutils' lazy .plt: push; jmp for PLT0, then 16-byte entries.
    let table = compile(
        standard_cie(),
        vec![
            fde(
                0x1020,
                0x20,
                &[
                    (0, I::CfaOffset(16)),
                    (6, I::CfaOffset(24)),
                    (16, I::CfaExpression(plt_expression(11))),
                ],
            ),
            fde(0x2000, 0x10, &[(0, I::CfaExpression(plt_expression(10)))]),
        ],
    );
    assert_eq!(
        rows(&table),
        [
            (0x1020, Some(Rsp { cfa_off: 16 })),
            (0x1026, Some(Rsp { cfa_off: 24 })),
            (0x1030, Some(Plt { threshold: 11 })),
            (0x1040, None),
            (0x2000, Some(Plt { threshold: 10 })),
            (0x2010, None),
        ]
    );
}

#[test]
fn other_cfa_expressions_are_unsupported() {
    let mut deref = Expression::new();
    deref.op_breg(X86_64::RSP, 160);
    deref.op_deref();
    // The PLT shape, but based on rsp + 16.
    let mut bytes = plt_expression(11)
        .as_raw()
        .expect("raw expression")
        .to_vec();
    bytes[1] = 16;
    let plt_with_other_base = Expression::raw(bytes);
    let table = compile(
        standard_cie(),
        vec![
            fde(0x1000, 0x10, &[(0, I::CfaExpression(deref))]),
            fde(0x1010, 0x10, &[(0, I::CfaExpression(plt_with_other_base))]),
        ],
    );
    assert_eq!(
        rows(&table),
        [
            (0x1000, Some(Unsupported(UnsupportedCfi::CfaExpression))),
            (0x1020, None),
        ]
    );
}

#[test]
fn undefined_rip_is_outermost() {
    // glibc's _start: the CIE itself says there is no return address.
    let mut start_cie = standard_cie();
    start_cie.add_instruction(I::Undefined(X86_64::RA));
    let table = compile(start_cie, vec![fde(0x1070, 0x22, &[])]);
    assert_eq!(rows(&table), [(0x1070, Some(Outermost)), (0x1092, None)]);

    // clone's child path: undefined from some point in the function on.
    let table = compile(
        standard_cie(),
        vec![fde(0x3000, 0x40, &[(0x20, I::Undefined(X86_64::RA))])],
    );
    assert_eq!(
        rows(&table),
        [
            (0x3000, Some(Rsp { cfa_off: 8 })),
            (0x3020, Some(Outermost)),
            (0x3040, None),
        ]
    );
}

#[test]
fn signal_trampoline_rows_are_signal_frames() {
    // glibc's __restore_rt: augmentation "zRS", CFA and registers given by
    // expressions over the ucontext at rsp. The FDE starts one byte early
    // so that a lookup of the return address minus one still lands in it.
    let mut cie = CommonInformationEntry::new(ENCODING, 1, -8, X86_64::RA);
    cie.signal_trampoline = true;
    let mut cfa = Expression::new();
    cfa.op_breg(X86_64::RSP, 160);
    cfa.op_deref();
    let at = |offset| {
        let mut expression = Expression::new();
        expression.op_breg(X86_64::RSP, offset);
        expression
    };
    let table = compile(
        cie,
        vec![fde(
            0x3c04f,
            0x0a,
            &[
                (0, I::CfaExpression(cfa)),
                (0, I::Expression(X86_64::RBP, at(120))),
                (0, I::Expression(X86_64::RSP, at(160))),
                (0, I::Expression(X86_64::RA, at(168))),
            ],
        )],
    );
    assert_eq!(
        rows(&table),
        [(0x3c04f, Some(SignalFrame)), (0x3c059, None)]
    );
}

#[test]
fn unexpressible_rules_are_unsupported() {
    let mut rbp_expression = Expression::new();
    rbp_expression.op_breg(X86_64::RBP, 0);
    let cases = [
        (I::Cfa(X86_64::R10, 0), UnsupportedCfi::CfaRegister),
        (I::Offset(X86_64::RA, -16), UnsupportedCfi::ReturnAddress),
        (I::SameValue(X86_64::RA), UnsupportedCfi::ReturnAddress),
        (I::Register(X86_64::RBP, X86_64::RBX), UnsupportedCfi::Rbp),
        (I::ValOffset(X86_64::RBP, -16), UnsupportedCfi::Rbp),
        (
            I::Expression(X86_64::RBP, rbp_expression),
            UnsupportedCfi::Rbp,
        ),
        (I::Undefined(X86_64::RBP), UnsupportedCfi::Rbp),
        (I::Offset(X86_64::RSP, -16), UnsupportedCfi::Rsp),
    ];
    for (instruction, reason) in cases {
        let table = compile(
            standard_cie(),
            vec![fde(0x1000, 0x10, &[(4, instruction.clone())])],
        );
        assert_eq!(
            rows(&table),
            [
                (0x1000, Some(Rsp { cfa_off: 8 })),
                (0x1004, Some(Unsupported(reason))),
                (0x1010, None),
            ],
            "{instruction:?}"
        );
    }

    // A CIE whose return address column is not 16.
    let mut cie = CommonInformationEntry::new(ENCODING, 1, -8, X86_64::RBX);
    cie.add_instruction(I::Cfa(X86_64::RSP, 8));
    cie.add_instruction(I::Offset(X86_64::RBX, -8));
    let table = compile(cie, vec![fde(0x1000, 0x10, &[])]);
    assert_eq!(
        rows(&table),
        [
            (0x1000, Some(Unsupported(UnsupportedCfi::ReturnAddress))),
            (0x1010, None)
        ]
    );

    // The rsp rule a few hand-written assembly functions state explicitly.
    let table = compile(
        standard_cie(),
        vec![fde(0x1000, 0x10, &[(0, I::ValOffset(X86_64::RSP, 0))])],
    );
    assert_eq!(
        rows(&table),
        [(0x1000, Some(Rsp { cfa_off: 8 })), (0x1010, None)]
    );
}

#[test]
fn gaps_between_fdes_have_no_rule() {
    // A function split into hot and cold fragments (BOLT, GCC's
    // .text.unlikely) has one FDE per fragment, in any order.
    let table = compile(
        standard_cie(),
        vec![
            fde(0x9000, 0x10, &[(1, I::CfaOffset(16))]),
            fde(0x1000, 0x10, &[(1, I::CfaOffset(16))]),
            // Adjacent to the first and with the same rule: merges.
            fde(0x1010, 0x08, &[(0, I::CfaOffset(16))]),
            fde(0x0000, 0, &[]), // empty: ignored
        ],
    );
    assert_eq!(
        rows(&table),
        [
            (0x1000, Some(Rsp { cfa_off: 8 })),
            (0x1001, Some(Rsp { cfa_off: 16 })),
            (0x1018, None),
            (0x9000, Some(Rsp { cfa_off: 8 })),
            (0x9001, Some(Rsp { cfa_off: 16 })),
            (0x9010, None),
        ]
    );
    assert_eq!(table.lookup(0x1017), Some(Rsp { cfa_off: 16 }));
    assert_eq!(table.lookup(0x1018), None);
    assert_eq!(table.lookup(0x8fff), None);
    assert_eq!(table.lookup(0x9010), None);
}

#[test]
fn overlapping_fdes_never_borrow_the_wrong_rule() {
    let table = compile(
        standard_cie(),
        vec![
            fde(0x1000, 0x40, &[(1, I::CfaOffset(16))]),
            // Nested inside the first: it wins from its start, and the rest
            // of the first becomes a gap rather than keeping the nested rule.
            fde(0x1010, 0x10, &[(0, I::CfaOffset(48))]),
        ],
    );
    assert_eq!(
        rows(&table),
        [
            (0x1000, Some(Rsp { cfa_off: 8 })),
            (0x1001, Some(Rsp { cfa_off: 16 })),
            (0x1010, Some(Rsp { cfa_off: 48 })),
            (0x1020, None),
        ]
    );
}

#[test]
fn debug_frame_gives_the_same_rows() {
    let fdes = || {
        vec![fde(
            0x1000,
            0x20,
            &[(1, I::CfaOffset(16)), (1, I::Offset(X86_64::RBP, -16))],
        )]
    };
    let mut section = DebugFrame(EndianVec::new(LittleEndian));
    frame_table(standard_cie(), fdes())
        .write_debug_frame(&mut section)
        .expect("writing .debug_frame");
    let from_debug = UnwindTable::from_debug_frame(&section.0.take()).expect("compiling");
    let from_eh = compile(standard_cie(), fdes());
    assert_eq!(rows(&from_debug), rows(&from_eh));
    assert_eq!(from_debug.len(), 3);
}

/// A `.eh_frame` section from raw parts: one "zR" CIE with absolute FDE
/// pointers, then FDEs, each `(start, length, instructions)`.
fn raw_eh_frame(cie_instructions: &[u8], fdes: &[(u64, u64, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut cie = vec![0, 0, 0, 0, 1, b'z', b'R', 0, 1, 0x78, 16, 1, 0x00];
    cie.extend_from_slice(cie_instructions);
    out.extend_from_slice(&(cie.len() as u32).to_le_bytes());
    out.extend_from_slice(&cie);
    for &(start, length, instructions) in fdes {
        let mut fde = Vec::new();
        // CIE pointer: distance from this field back to the CIE at 0.
        fde.extend_from_slice(&(out.len() as u32 + 4).to_le_bytes());
        fde.extend_from_slice(&start.to_le_bytes());
        fde.extend_from_slice(&length.to_le_bytes());
        fde.push(0); // augmentation data length
        fde.extend_from_slice(instructions);
        out.extend_from_slice(&(fde.len() as u32).to_le_bytes());
        out.extend_from_slice(&fde);
    }
    out.extend_from_slice(&[0, 0, 0, 0]);
    out
}

/// def_cfa rsp+8; offset r16 at cfa-8
const STANDARD_CIE_PROGRAM: &[u8] = &[0x0c, 7, 8, 0x80 | 16, 1];

#[test]
fn raw_section_matches_the_writer() {
    // Guards the raw builder the tests below rely on.
    let raw = raw_eh_frame(STANDARD_CIE_PROGRAM, &[(0x1000, 0x10, &[0x41, 0x0e, 16])]);
    let table = UnwindTable::from_eh_frame(&raw, 0).expect("compiling");
    let written = compile(
        standard_cie(),
        vec![fde(0x1000, 0x10, &[(1, I::CfaOffset(16))])],
    );
    assert_eq!(rows(&table), rows(&written));
}

#[test]
fn set_loc_starts_a_row() {
    let mut program = vec![0x01]; // DW_CFA_set_loc
    program.extend_from_slice(&0x1008u64.to_le_bytes());
    program.extend_from_slice(&[0x0e, 24]);
    let raw = raw_eh_frame(STANDARD_CIE_PROGRAM, &[(0x1000, 0x10, &program)]);
    let table = UnwindTable::from_eh_frame(&raw, 0).expect("compiling");
    assert_eq!(
        rows(&table),
        [
            (0x1000, Some(Rsp { cfa_off: 8 })),
            (0x1008, Some(Rsp { cfa_off: 24 })),
            (0x1010, None),
        ]
    );
}

#[test]
fn a_program_gimli_rejects_marks_only_its_fde() {
    let raw = raw_eh_frame(
        STANDARD_CIE_PROGRAM,
        &[
            // advance 1, def_cfa_offset 16, advance 1, restore_state with
            // nothing remembered.
            (0x1000, 0x10, &[0x41, 0x0e, 16, 0x41, 0x0b]),
            // An opcode in the user range no producer defines.
            (0x2000, 0x10, &[0x41, 0x3e]),
            (0x3000, 0x10, &[0x41, 0x0e, 16]),
        ],
    );
    let table = UnwindTable::from_eh_frame(&raw, 0).expect("compiling");
    let program = Some(Unsupported(UnsupportedCfi::Program));
    assert_eq!(
        rows(&table),
        [
            (0x1000, program),
            (0x1010, None),
            (0x2000, program),
            (0x2010, None),
            (0x3000, Some(Rsp { cfa_off: 8 })),
            (0x3001, Some(Rsp { cfa_off: 16 })),
            (0x3010, None),
        ]
    );
}

#[test]
fn rows_past_the_fde_end_are_dropped() {
    // advance_loc beyond the FDE's length.
    let raw = raw_eh_frame(STANDARD_CIE_PROGRAM, &[(0x1000, 0x10, &[0x60, 0x0e, 16])]);
    let table = UnwindTable::from_eh_frame(&raw, 0).expect("compiling");
    assert_eq!(
        rows(&table),
        [(0x1000, Some(Rsp { cfa_off: 8 })), (0x1010, None)]
    );
}

#[test]
fn empty_section_gives_an_empty_table() {
    let table = UnwindTable::from_eh_frame(&[], 0).expect("compiling");
    assert!(table.is_empty());
    assert_eq!(table.lookup(0), None);
    let table = UnwindTable::from_eh_frame(&[0, 0, 0, 0], 0).expect("compiling");
    assert!(table.is_empty());
}

fn cfi_error(result: Result<UnwindTable, TableError>) -> gimli::Error {
    match result {
        Err(TableError::Cfi {
            section: CfiSection::EhFrame,
            source,
        }) => source,
        other => panic!("expected a .eh_frame parse error, got {other:?}"),
    }
}

#[test]
fn every_truncation_is_an_eof_error_or_a_shorter_table() {
    let raw = raw_eh_frame(
        STANDARD_CIE_PROGRAM,
        &[
            (0x1000, 0x10, &[0x41, 0x0e, 16]),
            (0x2000, 0x10, &[0x41, 0x0e, 16]),
        ],
    );
    // Entry boundaries: the CIE ends at 4 + 18, each FDE is 4 + 24 long.
    let boundaries = [0usize, 22, 50, 78];
    for len in 0..raw.len() {
        let result = UnwindTable::from_eh_frame(&raw[..len], 0);
        if boundaries.contains(&len) {
            let table = result.expect("a cut between entries is a valid section");
            assert_eq!(
                table.len(),
                [0, 0, 3, 6][boundaries.iter().position(|&b| b == len).unwrap_or(0)]
            );
        } else {
            assert!(
                matches!(cfi_error(result), gimli::Error::UnexpectedEof(_)),
                "cut at {len}"
            );
        }
    }
}

#[test]
fn malformed_headers_give_exact_errors() {
    // CIE with version 0xff.
    let bad_version = [8, 0, 0, 0, 0, 0, 0, 0, 0xff, 0, 0, 0];
    assert_eq!(
        cfi_error(UnwindTable::from_eh_frame(&bad_version, 0)),
        gimli::Error::UnknownVersion(0xff)
    );

    // Augmentation "zX": X is not a known augmentation character.
    let mut raw = raw_eh_frame(STANDARD_CIE_PROGRAM, &[]);
    raw[10] = b'X';
    assert_eq!(
        cfi_error(UnwindTable::from_eh_frame(&raw, 0)),
        gimli::Error::UnknownAugmentation
    );

    // An FDE whose CIE pointer points before the section.
    let mut raw = raw_eh_frame(STANDARD_CIE_PROGRAM, &[(0x1000, 0x10, &[])]);
    raw[26..30].copy_from_slice(&0x1000u32.to_le_bytes());
    assert!(matches!(
        cfi_error(UnwindTable::from_eh_frame(&raw, 0)),
        gimli::Error::OffsetOutOfBounds(_)
    ));

    // An FDE whose range wraps past 2^64.
    let raw = raw_eh_frame(STANDARD_CIE_PROGRAM, &[(u64::MAX - 4, 0x10, &[])]);
    assert!(matches!(
        UnwindTable::from_eh_frame(&raw, 0),
        Err(TableError::FdeRange {
            section: CfiSection::EhFrame,
            offset: 22,
            start: 0xffff_ffff_ffff_fffb,
            length: 0x10
        })
    ));

    // FDEs more than 4 GiB apart.
    let raw = raw_eh_frame(
        STANDARD_CIE_PROGRAM,
        &[(0x1000, 0x10, &[]), (0x2_0000_0000, 0x10, &[])],
    );
    assert!(matches!(
        UnwindTable::from_eh_frame(&raw, 0),
        Err(TableError::AddressSpan {
            base: 0x1000,
            end: 0x2_0000_0000
        })
    ));
}

#[test]
fn garbage_never_panics() {
    // A cheap deterministic stand-in for the fuzz target: random bytes,
    // alone and spliced into a valid section.
    let valid = raw_eh_frame(
        STANDARD_CIE_PROGRAM,
        &[(0x1000, 0x10, &[0x41, 0x0e, 16, 0x0a, 0x41, 0x0b])],
    );
    use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
    let mut rng = StdRng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
    let mut next = move || rng.random::<u64>();
    for round in 0..2000 {
        let mut bytes = valid.clone();
        if round % 2 == 0 {
            let at = (next() as usize) % bytes.len();
            bytes[at] = next() as u8;
        } else {
            bytes = (0..(next() % 96)).map(|_| next() as u8).collect();
        }
        // Either outcome is fine; a panic is not.
        if let Ok(table) = UnwindTable::from_eh_frame(&bytes, 0) {
            let rows: Vec<_> = table.rows().collect();
            assert!(rows.windows(2).all(|w| w[0].0 < w[1].0));
            assert!(rows.last().is_none_or(|row| row.1.is_none()));
        }
        let _ = UnwindTable::from_debug_frame(&bytes);
    }
}
