//! Object identity of real files built by gcc: build-ids as the linker wrote
//! them, and keys that change when a file is replaced or rewritten (the
//! sysprof TODO: "libraries didn't get correctly reloaded after new versions
//! were installed").

mod common;

use std::{fs::File, os::unix::fs::MetadataExt as _, path::Path, time::Duration};

use stackscope_process_table::{
    FileKey, ObjectId, elf,
    object_id::{self, DigestBudget, Identity},
};

fn identify(path: &Path) -> Identity {
    identify_within(path, &mut DigestBudget::unlimited())
}

fn identify_within(path: &Path, budget: &mut DigestBudget) -> Identity {
    let file = File::open(path).expect("opening the library");
    let metadata = file.metadata().expect("fstat");
    object_id::identify_within(&file, &metadata, budget).expect("identifying the library")
}

#[test]
fn rebuilt_library_gets_a_new_build_id() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let v1 = dir.path().join("libv1.so");
    let v2 = dir.path().join("libv2.so");
    common::build_lib(&v1, 1, "sha1");
    common::build_lib(&v2, 2, "sha1");

    let (id1, id2) = (identify(&v1).id, identify(&v2).id);
    assert!(matches!(id1, ObjectId::BuildId(..)), "{id1:?}");
    assert_ne!(
        id1, id2,
        "a different constant must give a different build-id"
    );
    // The hex form is exactly what binutils reports.
    assert_eq!(Some(id1.to_string()), common::readelf_build_id(&v1));
    assert_eq!(Some(id2.to_string()), common::readelf_build_id(&v2));
    // SHA-1 build-ids are 20 bytes.
    assert_eq!(id1.to_string().len(), 40);
}

#[test]
fn explicit_build_id_is_read_exactly() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let lib = dir.path().join("lib.so");
    let hex = "0123456789abcdeffedcba9876543210aabbccdd";
    common::build_lib(&lib, 1, &format!("0x{hex}"));
    let identity = identify(&lib);
    assert_eq!(identity.id.to_string(), hex);
    let segments = identity.load_segments.expect("an ELF file has segments");
    assert!(segments.iter().any(|s| s.is_executable()), "{segments:?}");
}

#[test]
fn a_file_claiming_another_files_build_id_is_another_object() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let real = dir.path().join("libreal.so");
    let impostor = dir.path().join("libimpostor.so");
    let hex = "00112233445566778899aabbccddeeff00112233";
    common::build_lib(&real, 1, &format!("0x{hex}"));
    common::build_lib(&impostor, 2, &format!("0x{hex}"));
    let (real, impostor) = (identify(&real).id, identify(&impostor).id);
    // Both claim the build-id, which is what the wire carries...
    assert_eq!(real.build_id(), impostor.build_id());
    assert_eq!(real.to_string(), hex);
    // ...but nothing on the node shares state between them.
    assert_ne!(real, impostor);
    assert_ne!(real.unique_name(), impostor.unique_name());
}

#[test]
fn past_the_digest_budget_a_build_id_is_kept_but_not_shared() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let lib = dir.path().join("lib.so");
    let copy = dir.path().join("copy.so");
    common::build_lib(&lib, 1, "sha1");
    std::fs::copy(&lib, &copy).expect("copying the library");
    let size = std::fs::metadata(&lib).expect("stat").len();
    // Room for one file, never refilled.
    let mut budget = DigestBudget::new(size, 0);
    let digested = identify_within(&lib, &mut budget).id;
    let unverified = identify_within(&copy, &mut budget);
    assert!(matches!(digested, ObjectId::BuildId(..)), "{digested:?}");
    assert_eq!(
        unverified.id,
        ObjectId::UnverifiedBuildId(
            digested.build_id().expect("a build-id"),
            unverified.file_key
        )
    );
    // The collector still knows it by its build-id; the node shares nothing.
    assert_eq!(unverified.id.to_string(), digested.to_string());
    assert_ne!(unverified.id.unique_name(), digested.unique_name());
}

#[test]
fn copies_share_the_build_id_but_not_the_file_key() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let lib = dir.path().join("lib.so");
    let copy = dir.path().join("copy.so");
    common::build_lib(&lib, 1, "sha1");
    std::fs::copy(&lib, &copy).expect("copying the library");
    let (original, copied) = (identify(&lib), identify(&copy));
    assert_eq!(original.id, copied.id, "same contents, same object");
    assert_eq!(original.id.unique_name(), copied.id.unique_name());
    assert_ne!(original.file_key, copied.file_key, "different inodes");
}

#[test]
fn file_without_build_id_gets_a_key_that_changes_when_rewritten() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let lib = dir.path().join("lib.so");
    common::build_lib(&lib, 1, "none");
    assert_eq!(
        common::readelf_build_id(&lib),
        None,
        "built without a build-id"
    );
    let summary = elf::read_summary(&File::open(&lib).expect("opening")).expect("ELF");
    assert_eq!(summary.build_id, None);

    let first = identify(&lib);
    let metadata = std::fs::metadata(&lib).expect("stat");
    assert_eq!(
        first.id,
        ObjectId::FileKey(FileKey::from_metadata(&metadata))
    );
    assert!(first.id.to_string().starts_with("file-"), "{}", first.id);
    assert!(
        first.load_segments.is_some(),
        "still ELF, still has segments"
    );

    // Rewritten in place (same inode), as `cp new.so lib.so` does. The
    // kernel stamps mtime with a clock that ticks every few milliseconds,
    // so a rewrite within the same tick keeps the key (see FileKey): stamp
    // this one a second later, as a rewrite after the next tick is.
    let rebuilt = dir.path().join("rebuilt.so");
    common::build_lib(&rebuilt, 2, "none");
    std::fs::write(&lib, std::fs::read(&rebuilt).expect("reading")).expect("rewriting");
    File::options()
        .write(true)
        .open(&lib)
        .expect("opening")
        .set_modified(metadata.modified().expect("mtime") + Duration::from_secs(1))
        .expect("stamping the rewrite");
    let rewritten = identify(&lib);
    assert_eq!(
        rewritten.file_key.ino, first.file_key.ino,
        "rewritten in place"
    );
    assert_ne!(rewritten.id, first.id, "a rewrite must change the key");

    // Replaced by rename (new inode), as package managers and `install` do.
    let staged = dir.path().join("staged.so");
    std::fs::copy(&rebuilt, &staged).expect("staging");
    std::fs::rename(&staged, &lib).expect("replacing");
    let replaced = identify(&lib);
    assert_ne!(replaced.file_key.ino, rewritten.file_key.ino);
    assert_ne!(
        replaced.id, rewritten.id,
        "a replacement must change the key"
    );
    assert_eq!(
        replaced.id,
        ObjectId::FileKey(FileKey::from_metadata(
            &std::fs::metadata(&lib).expect("stat")
        ))
    );
    assert_eq!(
        replaced.file_key.mtime_ns,
        {
            let m = std::fs::metadata(&lib).expect("stat");
            m.mtime() * 1_000_000_000 + m.mtime_nsec()
        },
        "mtime in nanoseconds"
    );
}
