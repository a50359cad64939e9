//! Recorded samples of a real program, and both unwinders set up over them.
//!
//! This module owns the benchmark's inputs: compiling and running the
//! `tests/fixtures/busy.c` workload, stopping it N times with ptrace to take
//! what the BPF sampler would take (rip/rsp/rbp and the stack bytes from rsp,
//! through the test helper `common::snapshot`), the ELF files it maps with
//! their load biases, and, over exactly those inputs, our `ModuleLookup` with
//! prebuilt tables and a framehop `UnwinderX86_64` with modules built from the
//! same files' sections. It does not time anything (see `main.rs`).

use std::{collections::HashMap, ops::Range, path::PathBuf, thread::sleep, time::Duration};

use framehop::{
    ExplicitModuleSectionInfo, Module, Unwinder as _,
    x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64},
};
use object::{Object as _, ObjectSection as _};
use stackscope_process_table::maps::parse_maps;
use stackscope_test_fixtures::Fixture;
use stackscope_unwind::{ModuleAt, ModuleLookup, Registers, UnwindEnd, UnwindTable, unwind};

use crate::common;

/// One recorded sample: the registers and the stack bytes at `regs.rsp`.
pub struct Sample {
    pub regs: Registers,
    pub stack: Vec<u8>,
}

/// An ELF file mapped by the recorded process.
pub struct MappedFile {
    pub path: PathBuf,
    pub data: Vec<u8>,
    /// From the lowest mapping's start to the highest one's end.
    pub avma: Range<u64>,
    /// File virtual address = runtime address - bias.
    pub bias: u64,
}

/// Everything the unwinding comparison reads.
pub struct Recording {
    pub samples: Vec<Sample>,
    pub files: Vec<MappedFile>,
    /// Samples whose `/proc/<pid>/maps` differed from the first one's: the
    /// replay uses the first one's, so this must be 0 for a fair comparison.
    pub maps_changed: usize,
}

/// Compiles the fixture into a temporary directory (removed when this
/// returns), runs it, takes `count` snapshots of up to `stack_bytes` each at
/// different moments, and kills it.
pub fn record(count: usize, stack_bytes: usize) -> Recording {
    let fixture = Fixture::compile("busy", &[]);
    let running = fixture.start(&[]);
    let pid = running.pid();

    let mut samples = Vec::with_capacity(count);
    let mut first_maps = None;
    let mut maps_changed = 0;
    for i in 0..count {
        // Uneven pauses (0.2 to 1.2 ms) so the stops fall at unrelated points
        // of the fixture's loop rather than in step with it.
        sleep(Duration::from_micros(200 + (i as u64 * 7919) % 1000));
        let snapshot = common::snapshot(pid, stack_bytes);
        match &first_maps {
            None => first_maps = Some(snapshot.maps),
            Some(first) if *first != snapshot.maps => maps_changed += 1,
            Some(_) => {}
        }
        samples.push(Sample {
            regs: snapshot.regs,
            stack: snapshot.stack,
        });
    }
    drop(running);
    let files = mapped_files(first_maps.as_deref().unwrap_or_default());
    Recording {
        samples,
        files,
        maps_changed,
    }
}

/// The ELF files in `maps`, each read once, with its address range and bias.
fn mapped_files(maps: &str) -> Vec<MappedFile> {
    let mut files: Vec<MappedFile> = Vec::new();
    let mut by_path: HashMap<PathBuf, usize> = HashMap::new();
    for mapping in parse_maps(maps.as_bytes()).expect("parsing maps") {
        // The vDSO and anonymous memory have no file to read CFI from.
        let Some(path) = mapping.path.file_path() else {
            continue;
        };
        let (start, end) = (mapping.start, mapping.end);
        let index = *by_path.entry(path.to_owned()).or_insert_with(|| {
            files.push(MappedFile {
                path: path.to_owned(),
                data: std::fs::read(path).expect("reading a mapped file"),
                avma: start..end,
                bias: 0,
            });
            files.len() - 1
        });
        let file = &mut files[index];
        file.avma = file.avma.start.min(start)..file.avma.end.max(end);
        if let Some(bias) = common::mapping_bias(&mapping) {
            file.bias = bias;
        }
    }
    files.sort_by_key(|file| file.avma.start);
    files
}

/// Our side: one prebuilt table per file, found by binary search over the
/// files' address ranges (what an agent's process table does).
pub struct OurModules {
    /// Sorted by range start, non-overlapping.
    modules: Vec<(Range<u64>, u64, Option<UnwindTable>)>,
}

impl OurModules {
    pub fn new(files: &[MappedFile]) -> Self {
        Self {
            modules: files
                .iter()
                .map(|file| {
                    (
                        file.avma.clone(),
                        file.bias,
                        UnwindTable::from_elf(&file.data).ok(),
                    )
                })
                .collect(),
        }
    }
}

impl ModuleLookup for OurModules {
    #[inline]
    fn module_for(&self, pc: u64) -> ModuleAt<'_> {
        let next = self
            .modules
            .partition_point(|(range, _, _)| range.start <= pc);
        match next.checked_sub(1).map(|index| &self.modules[index]) {
            Some((range, bias, table)) if pc < range.end => match table {
                Some(table) => ModuleAt::Table {
                    table,
                    bias: *bias,
                    frame_pointer_gaps: false,
                },
                None => ModuleAt::NoCfi,
            },
            _ => ModuleAt::Unmapped,
        }
    }
}

/// The sections framehop reads on ELF: `.text`, `.eh_frame`, `.got` and,
/// when `with_hdr`, `.eh_frame_hdr` (its binary-search index; without it
/// framehop builds its own FDE index when the module is added).
pub fn section_info(data: &[u8], with_hdr: bool) -> ExplicitModuleSectionInfo<&[u8]> {
    let file = object::File::parse(data).expect("parsing an ELF file");
    let section = |name: &str| {
        let section = file.section_by_name(name)?;
        let range = section.address()..section.address() + section.size();
        Some((range, section.data().ok()?))
    };
    let text = section(".text");
    let eh_frame = section(".eh_frame");
    let eh_frame_hdr = section(".eh_frame_hdr").filter(|_| with_hdr);
    ExplicitModuleSectionInfo {
        // ELF files state addresses relative to 0.
        base_svma: 0,
        text_svma: text.as_ref().map(|(range, _)| range.clone()),
        text: text.map(|(_, data)| data),
        got_svma: section(".got").map(|(range, _)| range),
        eh_frame_svma: eh_frame.as_ref().map(|(range, _)| range.clone()),
        eh_frame: eh_frame.map(|(_, data)| data),
        eh_frame_hdr_svma: eh_frame_hdr.as_ref().map(|(range, _)| range.clone()),
        eh_frame_hdr: eh_frame_hdr.map(|(_, data)| data),
        ..Default::default()
    }
}

/// framehop's side: the same files at the same addresses, with
/// `.eh_frame_hdr` (how samply uses it on Linux).
pub fn framehop_unwinder(files: &[MappedFile]) -> UnwinderX86_64<&[u8]> {
    let mut unwinder = UnwinderX86_64::new();
    for file in files {
        unwinder.add_module(Module::new(
            file.path.display().to_string(),
            file.avma.clone(),
            // ELF: runtime address = file address + bias.
            file.bias,
            section_info(&file.data, true),
        ));
    }
    unwinder
}

/// Walks `sample` with our tables.
#[inline]
pub fn walk_ours(
    sample: &Sample,
    modules: &OurModules,
    max_depth: usize,
    frames: &mut Vec<u64>,
) -> UnwindEnd {
    unwind(sample.regs, &sample.stack, modules, max_depth, frames)
}

/// Walks `sample` with framehop, reading stack words from the same bytes and
/// stopping at the same depth limit; returns the error framehop ended with,
/// if it did not find the outermost frame.
#[inline]
pub fn walk_framehop(
    sample: &Sample,
    unwinder: &UnwinderX86_64<&[u8]>,
    cache: &mut CacheX86_64,
    max_depth: usize,
    frames: &mut Vec<u64>,
) -> Option<framehop::Error> {
    frames.clear();
    let Registers { rip, rsp, rbp } = sample.regs;
    let stack = &sample.stack[..];
    let mut read_stack = |address: u64| {
        let offset = usize::try_from(address.checked_sub(rsp).ok_or(())?).map_err(|_| ())?;
        let word = stack.get(offset..).and_then(|rest| rest.first_chunk::<8>());
        word.map(|word| u64::from_le_bytes(*word)).ok_or(())
    };
    let mut iter = unwinder.iter_frames(
        rip,
        UnwindRegsX86_64::new(rip, rsp, rbp),
        cache,
        &mut read_stack,
    );
    while frames.len() < max_depth {
        match iter.next() {
            Ok(Some(frame)) => frames.push(frame.address()),
            Ok(None) => return None,
            Err(error) => return Some(error),
        }
    }
    None
}
