//! The reads behind the process table: a process's `/proc/<pid>/maps`, and
//! the identity of each file it maps (`stat`, and on a cache miss an open
//! and a read of its ELF headers and digest).
//!
//! Owns: [`TableReader`], which does those reads on whatever thread holds
//! it, and the identity cache they share ([`Identities`], by file version
//! and by build-id). The table makes [`ReadRequest`]s and applies the
//! [`ReadAnswer`]s: at once, on its own thread, by default; or, with
//! [`TableConfig::defer_reads`](super::TableConfig::defer_reads), reads of
//! maps go through its owner, who runs them elsewhere (the agent's
//! metadata worker), so that the thread that walks samples never waits on
//! `/proc/<pid>/maps`. Files mapped while the agent ran are identified at
//! once either way (see `ProcessTable::lookup_at`).

use std::{
    collections::HashMap,
    fs::Metadata,
    path::Path,
    sync::{Arc, Mutex, Weak},
};

use super::{Backing, MappedRegion, MappingError, Region, bias};
use crate::{
    elf::LoadSegment,
    maps::{self, Mapping, MapsError},
    object_id::{self, BuildId, DigestBudget, FileKey, ObjectId},
    open::{self, OpenError, OpenedFile},
};

/// An identity in the cache, shared by every mapping of one file version.
#[derive(Debug)]
pub(super) struct CachedObject {
    pub(super) id: Arc<ObjectId>,
    pub(super) load_segments: Option<Vec<LoadSegment>>,
}

/// The identity last read from a file claiming a build-id: weak, so only
/// the cache by file version and the processes keep it.
#[derive(Debug)]
struct BuildIdClaim {
    object: Weak<CachedObject>,
    /// Files with different contents claimed the build-id (one of them
    /// lies): the build-id alone then says nothing of which file is mapped.
    contested: bool,
}

/// What a read asks for.
#[derive(Debug, Clone)]
pub enum ReadRequest {
    /// The process's maps, each file mapping identified.
    Maps { tgid: u32 },
    /// The identity of a file the process mapped while the agent ran (an
    /// mmap event said so, to it or to the parent it forked from): from
    /// the file, reached through the process or a root that holds it, or
    /// by the build-id the kernel read.
    Learned {
        tgid: u32,
        region: Arc<MappedRegion>,
        build_id: Option<BuildId>,
    },
}

impl ReadRequest {
    /// The process the read is for.
    pub fn tgid(&self) -> u32 {
        match self {
            Self::Maps { tgid } | Self::Learned { tgid, .. } => *tgid,
        }
    }
}

/// What a read found, for [`ProcessTable::apply`](super::ProcessTable::apply).
#[derive(Debug)]
pub struct ReadAnswer {
    pub(super) request: ReadRequest,
    pub(super) found: Found,
    pub(super) counts: IdentityCounts,
}

impl ReadAnswer {
    /// The process the read was for.
    pub fn tgid(&self) -> u32 {
        self.request.tgid()
    }

    /// The paths of the files the read was about: every file the maps
    /// showed, or the one learned file.
    pub fn file_paths(&self) -> Vec<&Path> {
        match (&self.request, &self.found) {
            (_, Found::Maps(Ok(regions))) => regions
                .iter()
                .filter_map(|region| region.region.mapping.path.file_path())
                .collect(),
            (ReadRequest::Learned { region, .. }, _) => {
                region.mapping.path.file_path().into_iter().collect()
            }
            _ => Vec::new(),
        }
    }
}

#[derive(Debug)]
pub(super) enum Found {
    Maps(Result<Vec<Region>, MapsReadError>),
    Learned(Backing),
}

/// Why a process's maps gave no regions.
#[derive(Debug)]
pub(super) enum MapsReadError {
    /// The process exited (or is a zombie).
    Gone,
    Unreadable(MapsError),
}

/// What identifying files cost, counted into the table's statistics when
/// the answer is applied.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct IdentityCounts {
    pub(super) objects_identified: u64,
    pub(super) build_ids_unverified: u64,
    pub(super) object_cache_hits: u64,
    pub(super) learned_unidentified: u64,
}

/// Identities of file versions read so far, by file version and by
/// build-id, and the budget that bounds the reading.
#[derive(Debug)]
pub(super) struct Identities {
    objects: HashMap<FileKey, Arc<CachedObject>>,
    /// The same identities by build-id, for mappings learned from events
    /// (whose file may be gone by the time they are read).
    by_build_id: HashMap<BuildId, BuildIdClaim>,
    digests: DigestBudget,
    max_cached_objects: usize,
}

/// Does the reads of one process table, on the thread that calls it; a
/// clone shares the table's identity cache.
#[derive(Debug, Clone)]
pub struct TableReader {
    pub(super) proc_root: Arc<Path>,
    pub(super) page_size: u64,
    identities: Arc<Mutex<Identities>>,
}

impl TableReader {
    pub(super) fn new(proc_root: Arc<Path>, page_size: u64, max_cached_objects: usize) -> Self {
        Self {
            proc_root,
            page_size,
            identities: Arc::new(Mutex::new(Identities {
                objects: HashMap::new(),
                by_build_id: HashMap::new(),
                digests: DigestBudget::default(),
                max_cached_objects,
            })),
        }
    }

    /// Does the read `request` asks for.
    pub fn read(&self, request: ReadRequest) -> ReadAnswer {
        let mut counts = IdentityCounts::default();
        // A panic while holding the lock left the cache whole (every
        // insertion is one statement): go on with it.
        let mut identities = self
            .identities
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let found = match &request {
            ReadRequest::Maps { tgid } => {
                Found::Maps(self.read_maps(*tgid, &mut identities, &mut counts))
            }
            ReadRequest::Learned {
                region, build_id, ..
            } => Found::Learned(self.identify_learned(
                region,
                *build_id,
                &mut identities,
                &mut counts,
            )),
        };
        identities.trim();
        ReadAnswer {
            request,
            found,
            counts,
        }
    }

    /// Number of file versions in the identity cache.
    pub(super) fn cached_objects(&self) -> usize {
        self.identities
            .lock()
            .map_or(0, |identities| identities.objects.len())
    }

    fn read_maps(
        &self,
        tgid: u32,
        identities: &mut Identities,
        counts: &mut IdentityCounts,
    ) -> Result<Vec<Region>, MapsReadError> {
        let mappings = match maps::read_maps_at(&self.proc_root, tgid) {
            Ok(mappings) => mappings,
            Err(MapsError::ProcessGone { .. }) => return Err(MapsReadError::Gone),
            Err(source) => return Err(MapsReadError::Unreadable(source)),
        };
        let mut regions = Vec::new();
        for mapping in mappings.into_iter().filter(|m| m.perms.exec) {
            let backing = if mapping.is_file_backed() {
                match self.identify(tgid, &mapping, identities, counts) {
                    Ok(object) => {
                        let bias = object
                            .load_segments
                            .as_deref()
                            .and_then(|segments| bias(&mapping, segments, self.page_size));
                        Backing::Object { object, bias }
                    }
                    Err(MappingError::Open(OpenError::ProcessGone { .. })) => {
                        return Err(MapsReadError::Gone);
                    }
                    Err(err) => {
                        tracing::debug!(
                            tgid,
                            start = mapping.start,
                            path = %mapping.path,
                            error = %err,
                            "cannot identify a mapped file"
                        );
                        Backing::Failed(Arc::new(err))
                    }
                }
            } else {
                Backing::Unbacked
            };
            regions.push(Region {
                region: Arc::new(MappedRegion {
                    tgid,
                    mapping,
                    proc_root: Arc::clone(&self.proc_root),
                    learned: None,
                }),
                backing,
            });
        }
        // The kernel prints maps sorted; sorting again costs little and keeps
        // lookups correct for a hand-written proc root.
        regions.sort_by_key(|region| region.region.mapping.start);
        Ok(regions)
    }

    /// The identity of a mapped file, from the cache when this version of
    /// the file (by `stat`) was seen before.
    fn identify(
        &self,
        tgid: u32,
        mapping: &Mapping,
        identities: &mut Identities,
        counts: &mut IdentityCounts,
    ) -> Result<Arc<CachedObject>, MappingError> {
        let (metadata, _) =
            open::stat_mapped(&self.proc_root, tgid, mapping).map_err(MappingError::Open)?;
        if let Some(object) = identities.cached(&metadata, counts) {
            return Ok(object);
        }
        let opened =
            open::open_mapped(&self.proc_root, tgid, mapping).map_err(MappingError::Open)?;
        // Keyed by the opened file's own metadata: the file may have been
        // rewritten between the stat and the open.
        identities.identify_opened(&opened, counts)
    }

    /// The backing of a file mapped while the agent ran: from the file
    /// itself, reached through the process's `map_files` or else under the
    /// roots of its learned list in turn (see [`open`]); from the cache,
    /// without opening it,
    /// when this version of it (as for a maps read: device, inode, size and
    /// modification time) was identified before. When no such file is
    /// left, by the build-id the kernel reported, if only one file's
    /// contents are known under it. The file comes first because any
    /// process may map one that claims another's build-id.
    fn identify_learned(
        &self,
        region: &MappedRegion,
        build_id: Option<BuildId>,
        identities: &mut Identities,
        counts: &mut IdentityCounts,
    ) -> Backing {
        let known = region.recognize(|metadata| identities.version(metadata));
        let identified = match known {
            Some(object) => {
                counts.object_cache_hits += 1;
                Ok(object)
            }
            None => Self::open_learned(region, build_id, identities, counts),
        };
        match identified {
            Ok(object) => {
                let bias = object
                    .load_segments
                    .as_deref()
                    .and_then(|segments| bias(&region.mapping, segments, self.page_size));
                Backing::Object { object, bias }
            }
            Err(err) => {
                counts.learned_unidentified += 1;
                tracing::debug!(
                    tgid = region.tgid,
                    start = region.mapping.start,
                    path = %region.mapping.path,
                    error = %err,
                    "cannot identify a file mapped while the agent ran"
                );
                Backing::Failed(Arc::new(err))
            }
        }
    }

    /// The identity of a learned mapping's file, opened (and read on a
    /// cache miss); when no such file is left, by the build-id alone if
    /// only one file's contents are known under it.
    fn open_learned(
        region: &MappedRegion,
        build_id: Option<BuildId>,
        identities: &mut Identities,
        counts: &mut IdentityCounts,
    ) -> Result<Arc<CachedObject>, MappingError> {
        match region.open() {
            Ok(opened) => identities
                .identify_opened(&opened, counts)
                .and_then(|object| match build_id {
                    Some(expected) if object.id.build_id() != Some(expected) => {
                        Err(MappingError::OtherFile)
                    }
                    _ => Ok(object),
                }),
            Err(err) => build_id
                .and_then(|id| identities.by_build_id.get(&id))
                .filter(|claim| !claim.contested)
                .and_then(|claim| claim.object.upgrade())
                .inspect(|_| counts.object_cache_hits += 1)
                .ok_or(MappingError::Open(err)),
        }
    }
}

impl Identities {
    /// The identity of an opened file: from the cache when this version of
    /// it (by its own `fstat`) was seen before, else read (digested within
    /// the budget) and cached.
    fn identify_opened(
        &mut self,
        opened: &OpenedFile,
        counts: &mut IdentityCounts,
    ) -> Result<Arc<CachedObject>, MappingError> {
        if let Some(object) = self.cached(&opened.metadata, counts) {
            return Ok(object);
        }
        let identity =
            object_id::identify_within(&opened.file, &opened.metadata, &mut self.digests)
                .map_err(MappingError::Identify)?;
        Ok(self.remember(identity, counts))
    }

    /// The cached identity of the file version `metadata` describes.
    fn cached(
        &mut self,
        metadata: &Metadata,
        counts: &mut IdentityCounts,
    ) -> Option<Arc<CachedObject>> {
        let object = self.version(metadata)?;
        counts.object_cache_hits += 1;
        Some(object)
    }

    /// The cached identity of the file version `metadata` describes,
    /// uncounted.
    fn version(&self, metadata: &Metadata) -> Option<Arc<CachedObject>> {
        self.objects.get(&FileKey::from_metadata(metadata)).cloned()
    }

    /// Caches a newly read identity by file version and build-id.
    fn remember(
        &mut self,
        identity: object_id::Identity,
        counts: &mut IdentityCounts,
    ) -> Arc<CachedObject> {
        counts.objects_identified += 1;
        if matches!(identity.id, ObjectId::UnverifiedBuildId(..)) {
            counts.build_ids_unverified += 1;
        }
        let object = Arc::new(CachedObject {
            id: Arc::new(identity.id),
            load_segments: identity.load_segments,
        });
        self.objects.insert(identity.file_key, Arc::clone(&object));
        if let Some(build_id) = identity.id.build_id() {
            let claim = self.by_build_id.entry(build_id).or_insert(BuildIdClaim {
                object: Weak::new(),
                contested: false,
            });
            if let Some(known) = claim.object.upgrade()
                && known.id != object.id
            {
                if !claim.contested {
                    tracing::warn!(
                        "files with different contents claim build-id {build_id}; \
                         mappings reported by that build-id alone stay unnamed"
                    );
                }
                claim.contested = true;
            }
            claim.object = Arc::downgrade(&object);
        }
        object
    }

    /// Keeps the cache bounded: past the cap, identities no tracked
    /// process maps are dropped. Ones still in use stay, so the cache can
    /// exceed the cap only as far as the processes' own mappings demand.
    fn trim(&mut self) {
        if self.objects.len() > self.max_cached_objects {
            self.objects
                .retain(|_, object| Arc::strong_count(object) > 1);
            self.by_build_id
                .retain(|_, claim| claim.object.strong_count() > 0);
        }
    }
}
