//! The process table against real processes: fixtures built by gcc with
//! explicit build-ids, so every expected identity and address is exact.

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use common::Target;
use stackscope_process_table::{
    BuildId, FileKey, Location, MappedObject, MappingPath, ObjectId, ProcessError, ProcessTable,
    TableConfig, elf,
    maps::{self, Mapping},
    open,
};

const TARGET_ID: &str = "5ca1ab1e000000000000000000000000000000a1";
const LIB_ID: &str = "deadbeef00000000000000000000000000000011";

fn build_id(hex: &str) -> Option<BuildId> {
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect();
    Some(BuildId::new(&bytes).expect("a valid build-id"))
}

/// The target and its library, built in a temporary directory.
struct Fixtures {
    dir: tempfile::TempDir,
}

impl Fixtures {
    fn build() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        common::build_target(&dir.path().join("target"), TARGET_ID);
        common::build_lib(&dir.path().join("lib.so"), 1, &format!("0x{LIB_ID}"));
        Self { dir }
    }

    fn target(&self) -> std::path::PathBuf {
        self.dir.path().join("target")
    }

    fn lib(&self) -> std::path::PathBuf {
        self.dir.path().join("lib.so")
    }
}

fn object(location: Option<Location>) -> MappedObject {
    match location {
        Some(Location::Object(object)) => object,
        other => panic!("expected an object, got {other:?}"),
    }
}

fn table_with_interval(interval: Duration) -> ProcessTable {
    ProcessTable::new(TableConfig {
        reread_interval: interval,
        ..TableConfig::default()
    })
}

#[test]
fn finds_executable_and_dlopened_library() {
    let fixtures = Fixtures::build();
    let target = Target::start(&fixtures.target(), Some(&fixtures.lib()));
    let lib_marker = target.lib_marker.expect("the library was loaded");
    let mut table = ProcessTable::default();

    let exe = object(table.lookup(target.pid(), target.marker).expect("lookup"));
    assert_eq!(exe.id.build_id(), build_id(TARGET_ID));
    assert_eq!(
        exe.path(),
        &MappingPath::File {
            path: fixtures.target(),
            deleted: false
        }
    );
    let marker_vaddr = common::symbol_value(&fixtures.target(), "target_marker");
    assert_eq!(exe.elf_vaddr, Some(marker_vaddr));
    assert_eq!(
        exe.file_offset,
        common::file_offset_of(&fixtures.target(), marker_vaddr)
    );
    assert!(exe.region.mapping.perms.exec);

    let lib = object(table.lookup(target.pid(), lib_marker).expect("lookup"));
    assert_eq!(lib.id.build_id(), build_id(LIB_ID));
    assert_eq!(lib.path().file_path(), Some(fixtures.lib().as_path()));
    let lib_vaddr = common::symbol_value(&fixtures.lib(), "lib_marker");
    assert_eq!(lib.elf_vaddr, Some(lib_vaddr));

    // Addresses further into the function map linearly.
    let later = object(table.lookup(target.pid(), lib_marker + 3).expect("lookup"));
    assert_eq!(later.elf_vaddr, Some(lib_vaddr + 3));

    // The table compiler can open the file through the mapping.
    let opened = lib.open().expect("opening the library");
    assert!(
        opened.path.to_string_lossy().contains("/map_files/") || !is_root(),
        "{}",
        opened.path.display()
    );
    let summary = elf::read_summary(&opened.file).expect("reading the library");
    assert_eq!(summary.build_id, build_id(LIB_ID));
    assert_eq!(
        lib.region.map_files_path(),
        open::map_files_path(
            std::path::Path::new("/proc"),
            target.pid(),
            lib.region.mapping.start,
            lib.region.mapping.end
        )
    );

    // Both objects came from the one read of the maps at first sight.
    assert_eq!(table.stats().maps_reads, 1);
}

#[test]
fn vdso_is_listed_with_its_bounds() {
    let fixtures = Fixtures::build();
    let target = Target::start(&fixtures.target(), None);
    let mut table = ProcessTable::default();
    let vdso = table
        .vdso(target.pid())
        .expect("reading the process")
        .expect("every x86_64 process has a vDSO");
    let (start, end) = common::maps_range(target.pid(), "[vdso]");
    assert_eq!((vdso.mapping.start, vdso.mapping.end), (start, end));
    assert_eq!(vdso.mapping.path, MappingPath::Vdso);
    match table.lookup(target.pid(), start + 0x10).expect("lookup") {
        Some(Location::Unbacked(region)) => assert_eq!(region.mapping.path, MappingPath::Vdso),
        other => panic!("expected the vDSO, got {other:?}"),
    }
}

#[test]
fn unknown_address_rereads_once_then_reports_none() {
    let fixtures = Fixtures::build();
    let target = Target::start(&fixtures.target(), None);
    let interval = Duration::from_secs(3600);
    let mut table = table_with_interval(interval);
    object(
        table
            .lookup(target.pid(), target.marker)
            .expect("first sight"),
    );
    assert_eq!(table.stats().maps_reads, 1);

    // An interval later, page 1 is still not mapped: one re-read, then
    // "nowhere".
    let later = Instant::now() + interval;
    assert!(
        table
            .lookup_at(target.pid(), 0x1000, later)
            .expect("lookup")
            .is_none()
    );
    assert_eq!(table.stats().maps_reads, 2);
    for _ in 0..1000 {
        assert!(
            table
                .lookup_at(target.pid(), 0x1000, later)
                .expect("lookup")
                .is_none()
        );
    }
    assert_eq!(table.stats().maps_reads, 2, "re-reads are rate limited");
    assert_eq!(table.stats().rereads_rate_limited, 1000);
    // Known addresses keep resolving without reads.
    object(table.lookup(target.pid(), target.marker).expect("lookup"));
    assert_eq!(table.stats().maps_reads, 2);
}

#[test]
fn exited_process_is_reported_gone() {
    let fixtures = Fixtures::build();
    let mut target = Target::start(&fixtures.target(), Some(&fixtures.lib()));
    let pid = target.pid();
    let interval = Duration::from_secs(3600);
    let mut table = table_with_interval(interval);
    let lib = object(
        table
            .lookup(pid, target.lib_marker.expect("library loaded"))
            .expect("lookup"),
    );
    target.exit();

    // A miss an interval later re-reads and finds the process gone; its
    // entry goes with it.
    let later = Instant::now() + interval;
    let err = table.lookup_at(pid, 0x1000, later).expect_err("gone");
    assert!(
        matches!(err, ProcessError::ProcessGone { tgid } if tgid == pid),
        "{err:?}"
    );
    assert!(!table.contains(pid));
    let err = table.lookup(pid, target.marker).expect_err("still gone");
    assert!(matches!(err, ProcessError::ProcessGone { .. }), "{err:?}");
    // Handles from before the exit fail cleanly too.
    let err = lib.open().expect_err("the process is gone");
    assert!(
        matches!(err, open::OpenError::ProcessGone { .. }),
        "{err:?}"
    );

    // The exit event path: remove() drops the entry without waiting for a miss.
    let mut other = Target::start(&fixtures.target(), None);
    object(table.lookup(other.pid(), other.marker).expect("lookup"));
    other.exit();
    table.remove(other.pid());
    let err = table.lookup(other.pid(), other.marker).expect_err("gone");
    assert!(matches!(err, ProcessError::ProcessGone { .. }), "{err:?}");
}

#[test]
fn exec_replaces_the_mappings() {
    let fixtures = Fixtures::build();
    let second_id = "5ca1ab1e000000000000000000000000000000b2";
    let second = fixtures.dir.path().join("second");
    common::build_target(&second, second_id);

    let mut target = Target::start(&fixtures.target(), Some(&fixtures.lib()));
    let pid = target.pid();
    let lib_marker = target.lib_marker.expect("library loaded");
    let mut table = ProcessTable::default();
    assert_eq!(
        object(table.lookup(pid, target.marker).expect("lookup"))
            .id
            .build_id(),
        build_id(TARGET_ID)
    );
    object(table.lookup(pid, lib_marker).expect("lookup"));

    target.exec(&second);
    table.exec(pid, 0);
    assert!(!table.contains(pid), "exec drops the old mappings");
    let new = object(table.lookup(pid, target.marker).expect("lookup"));
    assert_eq!(new.id.build_id(), build_id(second_id));
    assert_eq!(new.path().file_path(), Some(second.as_path()));
    // The library of the old program is not mapped by the new one; at most
    // the new program's own libraries could sit at that address.
    if let Some(Location::Object(found)) = table.lookup(pid, lib_marker).expect("lookup") {
        assert_ne!(
            found.id.build_id(),
            build_id(LIB_ID),
            "inherited a stale mapping"
        );
    }
}

#[test]
fn shared_libraries_are_identified_once() {
    let fixtures = Fixtures::build();
    let targets: Vec<Target> = (0..3)
        .map(|_| Target::start(&fixtures.target(), Some(&fixtures.lib())))
        .collect();
    let mut table = ProcessTable::default();

    let mut libc_ids = Vec::new();
    for (i, target) in targets.iter().enumerate() {
        let libc = object(
            table
                .lookup(
                    target.pid(),
                    common::exec_mapping_of(target.pid(), "/libc.so.6"),
                )
                .expect("lookup"),
        );
        assert!(
            matches!(*libc.id, ObjectId::BuildId(..)),
            "Debian's libc has a build-id"
        );
        libc_ids.push(libc.id);
        if i == 0 {
            let first = table.stats();
            // The target, lib.so, libc and ld.so at least.
            assert!(first.objects_identified >= 4, "{first:?}");
        }
    }
    let stats = table.stats();
    let after_first = stats.objects_identified;
    assert!(
        libc_ids
            .windows(2)
            .all(|pair| Arc::ptr_eq(&pair[0], &pair[1])),
        "every process shares one libc identity"
    );
    // The second and third process map the same files: all cache hits.
    assert_eq!(stats.maps_reads, 3);
    assert!(stats.object_cache_hits >= 2 * after_first, "{stats:?}");
    assert_eq!(table.cached_objects() as u64, after_first);
}

#[test]
fn library_without_build_id_is_keyed_by_file() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let exe = dir.path().join("target");
    let lib = dir.path().join("lib.so");
    common::build_target(&exe, TARGET_ID);
    common::build_lib(&lib, 7, "none");
    let target = Target::start(&exe, Some(&lib));
    let mut table = ProcessTable::default();
    let found = object(
        table
            .lookup(target.pid(), target.lib_marker.expect("library loaded"))
            .expect("lookup"),
    );
    let metadata = std::fs::metadata(&lib).expect("stat");
    assert_eq!(
        *found.id,
        ObjectId::FileKey(FileKey::from_metadata(&metadata))
    );
    // No build-id, but still ELF: the virtual address is known.
    assert_eq!(
        found.elf_vaddr,
        Some(common::symbol_value(&lib, "lib_marker"))
    );
}

#[test]
#[ignore = "needs root (opens /proc/PID/map_files): run by `cargo xtask test`"]
fn deleted_executable_is_opened_through_map_files() {
    common::require_root();
    let fixtures = Fixtures::build();
    let run_dir = tempfile::tempdir().expect("temporary directory");
    let copy = run_dir.path().join("target");
    std::fs::copy(fixtures.target(), &copy).expect("copying the binary");
    let target = Target::start(&copy, None);
    std::fs::remove_file(&copy).expect("deleting the running binary");

    let mapping: Mapping = maps::read_maps(target.pid())
        .expect("reading maps")
        .into_iter()
        .find(|m| m.perms.exec && m.contains(target.marker))
        .expect("the code mapping");
    assert_eq!(
        mapping.path,
        MappingPath::File {
            path: copy.clone(),
            deleted: true
        }
    );
    let opened = open::open_mapped(std::path::Path::new("/proc"), target.pid(), &mapping)
        .expect("opening through map_files");
    assert!(opened.path.to_string_lossy().contains("/map_files/"));
    let summary = elf::read_summary(&opened.file).expect("reading the deleted binary");
    assert_eq!(summary.build_id, build_id(TARGET_ID));

    let mut table = ProcessTable::default();
    let found = object(table.lookup(target.pid(), target.marker).expect("lookup"));
    assert_eq!(found.id.build_id(), build_id(TARGET_ID));
    assert!(found.path().is_deleted());
    assert_eq!(
        found.elf_vaddr,
        Some(common::symbol_value(&fixtures.target(), "target_marker"))
    );
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
