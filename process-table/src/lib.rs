//! What is mapped where in every process, and which file it is.
//!
//! The agent gets samples carrying a process id and user addresses. To
//! unwind and later symbolize them it needs, per address, the object file
//! (by an identity that is stable across processes, containers and
//! machines) and the address in that file's own terms. This crate provides
//! that, bottom-up:
//!
//! - [`maps`] parses `/proc/<pid>/maps` into [`maps::Mapping`]s;
//! - [`open`] reaches the exact file behind a mapping through
//!   `/proc/<pid>/map_files` (deleted files, containers) or the process's
//!   root, and once the process is gone, under its parent's, the agent's or
//!   the host's root, checked by build-id;
//! - [`elf`] reads an ELF file's build-id and `PT_LOAD` segments, lazily;
//! - [`object_id`] turns those into an [`ObjectId`]: the build-id, or a
//!   [`object_id::FileKey`] for files without one;
//! - [`table`] ties them together in a bounded [`ProcessTable`] answering
//!   [`ProcessTable::lookup`] for each sampled address.
//!
//! It does not say which container a process runs in
//! (`stackscope-metadata`), and does not unwind, compile unwind tables, symbolize, or learn about
//! process exits, execs, forks and mmaps by itself: the agent forwards
//! those events (`stackscope-process-events` reads the kernel's).

pub mod elf;
pub mod maps;
pub mod object_id;
pub mod open;
pub mod table;

pub use maps::{Mapping, MappingPath};
pub use object_id::{BuildId, ContentDigest, FileKey, ObjectId};
pub use table::{
    Location, MappedObject, MappedRegion, ModuleFile, ProcessError, ProcessTable, ReadAnswer,
    ReadRequest, Slot, TableConfig, TableReader,
};
