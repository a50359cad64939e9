//! Container names outside Kubernetes, from the runtime's own state on disk.
//!
//! A cgroup path gives the runtime and the container id; the name people
//! gave the container (`podman run --name api`, `docker run --name api`)
//! lives only in the runtime's state, which the agent reads from the host
//! (the DaemonSet mounts these directories read-only):
//!
//! - podman and everything else on containers-storage (Buildah, CRI-O's
//!   storage): `<storage root>/overlay-containers/containers.json`, one JSON
//!   array `[{"id": "<64 hex>", "names": ["api"], ...}]` for all containers;
//! - Docker: `<docker root>/containers/<id>/config.v2.json`, one file per
//!   container, with `"Name": "/api"` (the leading slash is dropped).
//!
//! Containers run by containerd or CRI-O are Kubernetes pods here: their
//! names come from the kubelet's pod list ([`crate::kubelet`]), so
//! [`RuntimeNames::name`] returns `None` for them.
//!
//! Lookups happen while samples are labelled, so every answer is cached:
//! podman's file is read again only when an id is missing from it and the
//! file changed (mtime, size or inode), at most once per
//! [`PODMAN_REREAD_INTERVAL`]; a Docker container's file is read once, and
//! a missing or unreadable one is not tried again for
//! [`NEGATIVE_TTL`]. Files above [`MAX_FILE_BYTES`] and malformed files are
//! logged once and give no names. At most [`MAX_ENTRIES`] entries are kept
//! per runtime.
//!
//! It does not watch the runtime's API or events; it never writes.

use std::{
    collections::HashMap,
    fs::{self, File},
    io::{self, Read as _},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use crate::container::Runtime;
use serde::Deserialize;

/// containers-storage's default root for system (rootful) containers.
pub const DEFAULT_PODMAN_STORAGE: &str = "/var/lib/containers/storage";
/// Docker's default data root.
pub const DEFAULT_DOCKER_ROOT: &str = "/var/lib/docker";

/// Files larger than this are not read: a state file that big is not one
/// the runtime wrote for a sane number of containers.
pub const MAX_FILE_BYTES: u64 = 64 << 20;
/// Cached names (and negative answers) per runtime before the cache starts
/// over.
pub const MAX_ENTRIES: usize = 65_536;
/// The shortest time between two checks of podman's file for new containers.
pub const PODMAN_REREAD_INTERVAL: Duration = Duration::from_secs(1);
/// How long a Docker container without a readable name is not looked up
/// again: its state is written a little after its first process starts.
pub const NEGATIVE_TTL: Duration = Duration::from_secs(10);

/// Names of podman and Docker containers by id; see the module documentation.
#[derive(Debug)]
pub struct RuntimeNames {
    /// `<storage root>/overlay-containers/containers.json`.
    podman_file: PathBuf,
    /// `<docker root>/containers`.
    docker_containers: PathBuf,
    podman: PodmanNames,
    docker: HashMap<Box<str>, DockerEntry>,
    limits: Limits,
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    max_entries: usize,
    podman_reread: Duration,
    negative_ttl: Duration,
}

const LIMITS: Limits = Limits {
    max_entries: MAX_ENTRIES,
    podman_reread: PODMAN_REREAD_INTERVAL,
    negative_ttl: NEGATIVE_TTL,
};

#[derive(Debug, Default)]
struct PodmanNames {
    by_id: HashMap<Box<str>, Arc<str>>,
    /// The file as it was when `by_id` was read from it; `None` before the
    /// first read and while the file is missing.
    read_stamp: Option<FileStamp>,
    /// When the file was last checked for changes.
    checked_at: Option<Instant>,
    /// The version of the file a warning was logged for.
    warned_stamp: Option<FileStamp>,
    /// Whether a failure to stat the file (other than its absence) was logged.
    warned_unreadable: bool,
}

/// What tells one version of a file from the next: runtimes replace their
/// state files by renaming a new one over them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

impl FileStamp {
    fn of(metadata: &fs::Metadata) -> Self {
        Self {
            modified: metadata.modified().ok(),
            len: metadata.len(),
            inode: metadata.ino(),
        }
    }
}

#[derive(Debug)]
enum DockerEntry {
    Named(Arc<str>),
    /// No name yet; looked up again after `retry_at`.
    Unnamed {
        retry_at: Instant,
        warned: bool,
    },
}

#[derive(Deserialize)]
struct PodmanContainer {
    id: String,
    #[serde(default)]
    names: Vec<String>,
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(rename = "Name", default)]
    name: Option<String>,
}

impl Default for RuntimeNames {
    /// The runtimes' default state directories: [`DEFAULT_PODMAN_STORAGE`]
    /// and [`DEFAULT_DOCKER_ROOT`].
    fn default() -> Self {
        Self::new(
            PathBuf::from(DEFAULT_PODMAN_STORAGE),
            PathBuf::from(DEFAULT_DOCKER_ROOT),
        )
    }
}

impl RuntimeNames {
    /// Names from containers-storage under `podman_storage` (its `--root`)
    /// and from Docker's data root `docker_root`. Nothing is read yet;
    /// missing directories just give no names.
    pub fn new(podman_storage: PathBuf, docker_root: PathBuf) -> Self {
        Self::with_limits(podman_storage, docker_root, LIMITS)
    }

    fn with_limits(podman_storage: PathBuf, docker_root: PathBuf, limits: Limits) -> Self {
        Self {
            podman_file: podman_storage.join("overlay-containers/containers.json"),
            docker_containers: docker_root.join("containers"),
            podman: PodmanNames::default(),
            docker: HashMap::new(),
            limits,
        }
    }

    /// The name of container `id` (64 hex digits) of `runtime`, if its
    /// runtime has written one. Always `None` for containerd and CRI-O,
    /// whose containers are named by the kubelet.
    pub fn name(&mut self, runtime: Runtime, id: &str) -> Option<Arc<str>> {
        // Ids come from cgroup paths; anything else must not become a path.
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        match runtime {
            Runtime::Podman => self.podman_name(id, Instant::now()),
            Runtime::Docker => self.docker_name(id, Instant::now()),
            Runtime::Containerd | Runtime::CriO => None,
        }
    }

    fn podman_name(&mut self, id: &str, now: Instant) -> Option<Arc<str>> {
        if let Some(name) = self.podman.by_id.get(id) {
            return Some(Arc::clone(name));
        }
        let podman = &mut self.podman;
        if podman
            .checked_at
            .is_some_and(|at| now.saturating_duration_since(at) < self.limits.podman_reread)
        {
            return None;
        }
        podman.checked_at = Some(now);
        let stamp = match fs::metadata(&self.podman_file) {
            Ok(metadata) => FileStamp::of(&metadata),
            Err(err) => {
                if err.kind() != io::ErrorKind::NotFound && !podman.warned_unreadable {
                    tracing::warn!(
                        "cannot read podman's container names from {}: {err}",
                        self.podman_file.display()
                    );
                    podman.warned_unreadable = true;
                }
                podman.by_id.clear();
                podman.read_stamp = None;
                return None;
            }
        };
        if podman.read_stamp == Some(stamp) {
            return None;
        }
        podman.read_stamp = Some(stamp);
        podman.by_id.clear();
        match read_podman_file(&self.podman_file, self.limits.max_entries) {
            Ok(by_id) => podman.by_id = by_id,
            Err(err) => {
                if podman.warned_stamp != Some(stamp) {
                    tracing::warn!(
                        "no podman container names from {}: {err}",
                        self.podman_file.display()
                    );
                    podman.warned_stamp = Some(stamp);
                }
            }
        }
        podman.by_id.get(id).cloned()
    }

    fn docker_name(&mut self, id: &str, now: Instant) -> Option<Arc<str>> {
        let mut warned = false;
        match self.docker.get(id) {
            Some(DockerEntry::Named(name)) => return Some(Arc::clone(name)),
            Some(&DockerEntry::Unnamed {
                retry_at,
                warned: was_warned,
            }) => {
                if now < retry_at {
                    return None;
                }
                warned = was_warned;
            }
            None => {}
        }
        let path = self.docker_containers.join(id).join("config.v2.json");
        let entry = match read_docker_file(&path) {
            Ok(Some(name)) => DockerEntry::Named(name),
            Ok(None) => DockerEntry::Unnamed {
                retry_at: now + self.limits.negative_ttl,
                warned,
            },
            Err(err) => {
                if !warned {
                    tracing::warn!(
                        "no name for Docker container {id} from {}: {err}",
                        path.display()
                    );
                }
                DockerEntry::Unnamed {
                    retry_at: now + self.limits.negative_ttl,
                    warned: true,
                }
            }
        };
        let name = match &entry {
            DockerEntry::Named(name) => Some(Arc::clone(name)),
            DockerEntry::Unnamed { .. } => None,
        };
        if self.docker.len() >= self.limits.max_entries && !self.docker.contains_key(id) {
            self.docker.clear();
        }
        self.docker.insert(id.into(), entry);
        name
    }

    /// Cached entries of both runtimes, for the cache bound's tests.
    #[cfg(test)]
    fn cached_entries(&self) -> usize {
        self.podman.by_id.len() + self.docker.len()
    }
}

/// Why a state file gave no names.
#[derive(Debug, thiserror::Error)]
enum StateFileError {
    /// Reading failed (other than the file being absent).
    #[error("reading: {0}")]
    Io(#[source] io::Error),
    /// Larger than [`MAX_FILE_BYTES`].
    #[error("{0} bytes, more than the {MAX_FILE_BYTES} read at most")]
    TooLarge(u64),
    /// Not the JSON the runtime writes.
    #[error("malformed: {0}")]
    Malformed(#[source] serde_json::Error),
}

/// The whole of `path`, unless it is larger than [`MAX_FILE_BYTES`];
/// `None` when it does not exist.
fn read_bounded(path: &Path) -> Result<Option<Vec<u8>>, StateFileError> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(StateFileError::Io(err)),
    };
    let len = file.metadata().map_err(StateFileError::Io)?.len();
    if len > MAX_FILE_BYTES {
        return Err(StateFileError::TooLarge(len));
    }
    let mut data = Vec::with_capacity(len as usize);
    // The file may grow between the stat and the read: never past the bound.
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut data)
        .map_err(StateFileError::Io)?;
    if data.len() as u64 > MAX_FILE_BYTES {
        return Err(StateFileError::TooLarge(data.len() as u64));
    }
    Ok(Some(data))
}

/// containers-storage's `containers.json`: the first name of each
/// container, at most `max_entries` of them.
fn read_podman_file(
    path: &Path,
    max_entries: usize,
) -> Result<HashMap<Box<str>, Arc<str>>, StateFileError> {
    let Some(data) = read_bounded(path)? else {
        return Ok(HashMap::new());
    };
    let containers: Vec<PodmanContainer> =
        serde_json::from_slice(&data).map_err(StateFileError::Malformed)?;
    Ok(containers
        .into_iter()
        .filter_map(|container| {
            let name = container.names.into_iter().next()?;
            Some((container.id.into_boxed_str(), Arc::from(name)))
        })
        .take(max_entries)
        .collect())
}

/// The `Name` in one Docker container's `config.v2.json`, without its
/// leading slash; `None` when the file or the name is missing.
fn read_docker_file(path: &Path) -> Result<Option<Arc<str>>, StateFileError> {
    let Some(data) = read_bounded(path)? else {
        return Ok(None);
    };
    let config: DockerConfig = serde_json::from_slice(&data).map_err(StateFileError::Malformed)?;
    Ok(config
        .name
        .map(|name| name.strip_prefix('/').unwrap_or(&name).to_owned())
        .filter(|name| !name.is_empty())
        .map(Arc::from))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID_A: &str = "f4abe5cb3cffbee1e3403a24413e5f2044e0c07bb1e09d0a61ea6e69e1266c77";
    const ID_B: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    /// No waiting between re-reads, so tests need no sleeps.
    const EAGER: Limits = Limits {
        max_entries: MAX_ENTRIES,
        podman_reread: Duration::ZERO,
        negative_ttl: Duration::ZERO,
    };

    struct Roots {
        podman: tempfile::TempDir,
        docker: tempfile::TempDir,
    }

    impl Roots {
        fn new() -> Self {
            let roots = Self {
                podman: tempfile::tempdir().expect("temporary directory"),
                docker: tempfile::tempdir().expect("temporary directory"),
            };
            fs::create_dir_all(roots.podman.path().join("overlay-containers"))
                .expect("overlay-containers");
            roots
        }

        fn names(&self, limits: Limits) -> RuntimeNames {
            RuntimeNames::with_limits(
                self.podman.path().to_path_buf(),
                self.docker.path().to_path_buf(),
                limits,
            )
        }

        fn write_podman_raw(&self, text: &str) {
            // As containers-storage does: a new file renamed over the old one.
            let dir = self.podman.path().join("overlay-containers");
            fs::write(dir.join("containers.json.tmp"), text).expect("writing");
            fs::rename(dir.join("containers.json.tmp"), dir.join("containers.json"))
                .expect("renaming");
        }

        fn write_podman(&self, containers: &[(&str, &str)]) {
            let entries: Vec<String> = containers
                .iter()
                .map(|(id, name)| {
                    format!(
                        r#"{{"id":"{id}","names":["{name}"],"image":"abc","layer":"def","metadata":"{{}}","created":"2025-01-01T00:00:00Z"}}"#
                    )
                })
                .collect();
            self.write_podman_raw(&format!("[{}]", entries.join(",")));
        }

        fn write_docker_raw(&self, id: &str, text: &str) {
            let dir = self.docker.path().join("containers").join(id);
            fs::create_dir_all(&dir).expect("container directory");
            fs::write(dir.join("config.v2.json"), text).expect("writing");
        }

        fn write_docker(&self, id: &str, name: &str) {
            self.write_docker_raw(
                id,
                &format!(
                    r#"{{"ID":"{id}","Name":"/{name}","State":{{"Running":true,"Pid":42}},"Config":{{"Hostname":"h"}}}}"#
                ),
            );
        }
    }

    fn hex_id(n: usize) -> String {
        format!("{n:064x}")
    }

    #[test]
    fn reads_podman_and_docker_state() {
        let roots = Roots::new();
        roots.write_podman(&[(ID_A, "api")]);
        roots.write_docker(ID_B, "web");
        let mut names = roots.names(LIMITS);
        assert_eq!(names.name(Runtime::Podman, ID_A).as_deref(), Some("api"));
        assert_eq!(names.name(Runtime::Docker, ID_B).as_deref(), Some("web"));
        // Each runtime reads only its own state.
        assert_eq!(names.name(Runtime::Docker, ID_A), None);
        assert_eq!(names.name(Runtime::Podman, ID_B), None);
        // Named by the kubelet, not here.
        assert_eq!(names.name(Runtime::Containerd, ID_A), None);
        assert_eq!(names.name(Runtime::CriO, ID_B), None);
        // Not an id: never a path.
        assert_eq!(names.name(Runtime::Docker, "../../etc"), None);
        assert_eq!(names.name(Runtime::Docker, ""), None);
    }

    #[test]
    fn cached_names_survive_the_files() {
        let roots = Roots::new();
        roots.write_podman(&[(ID_A, "api")]);
        roots.write_docker(ID_B, "web");
        let mut names = roots.names(EAGER);
        let first = names.name(Runtime::Podman, ID_A).expect("a name");
        names.name(Runtime::Docker, ID_B).expect("a name");
        fs::remove_dir_all(roots.docker.path().join("containers")).expect("removing");
        roots.write_podman_raw("not json");
        let again = names.name(Runtime::Podman, ID_A).expect("cached");
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(names.name(Runtime::Docker, ID_B).as_deref(), Some("web"));
    }

    #[test]
    fn missing_state_gives_no_names() {
        let mut names = RuntimeNames::new(
            PathBuf::from("/nonexistent/podman"),
            PathBuf::from("/nonexistent/docker"),
        );
        assert_eq!(names.name(Runtime::Podman, ID_A), None);
        assert_eq!(names.name(Runtime::Docker, ID_A), None);
    }

    #[test]
    fn new_podman_containers_appear_after_a_reread() {
        let roots = Roots::new();
        roots.write_podman(&[(ID_A, "api")]);
        let mut names = roots.names(LIMITS);
        let now = Instant::now();
        assert_eq!(names.podman_name(ID_A, now).as_deref(), Some("api"));
        assert_eq!(names.podman_name(ID_B, now), None);

        roots.write_podman(&[(ID_A, "api"), (ID_B, "worker")]);
        // Within the re-read interval the file is not looked at again.
        let soon = now + PODMAN_REREAD_INTERVAL / 2;
        assert_eq!(names.podman_name(ID_B, soon), None);
        let later = now + PODMAN_REREAD_INTERVAL;
        assert_eq!(names.podman_name(ID_B, later).as_deref(), Some("worker"));
        assert_eq!(names.podman_name(ID_A, later).as_deref(), Some("api"));

        // Removed containers are forgotten with the next read.
        roots.write_podman(&[(ID_B, "worker")]);
        let much_later = later + PODMAN_REREAD_INTERVAL;
        assert_eq!(names.podman_name(hex_id(7).as_str(), much_later), None);
        assert_eq!(names.podman_name(ID_A, much_later), None);
    }

    #[test]
    fn unchanged_podman_file_is_not_parsed_again() {
        let roots = Roots::new();
        roots.write_podman(&[(ID_A, "api")]);
        let mut names = roots.names(EAGER);
        assert_eq!(names.name(Runtime::Podman, ID_B), None);
        let stamp = names.podman.read_stamp.expect("read once");
        assert_eq!(names.name(Runtime::Podman, ID_B), None);
        assert_eq!(names.podman.read_stamp, Some(stamp));
        assert_eq!(names.name(Runtime::Podman, ID_A).as_deref(), Some("api"));
    }

    #[test]
    fn docker_names_appear_after_the_negative_ttl() {
        let roots = Roots::new();
        let mut names = roots.names(LIMITS);
        let now = Instant::now();
        assert_eq!(names.docker_name(ID_B, now), None);
        roots.write_docker(ID_B, "web");
        assert_eq!(names.docker_name(ID_B, now + NEGATIVE_TTL / 2), None);
        assert_eq!(
            names.docker_name(ID_B, now + NEGATIVE_TTL).as_deref(),
            Some("web")
        );
    }

    #[test]
    fn malformed_files_give_no_names_and_recover() {
        let roots = Roots::new();
        roots.write_podman_raw(r#"[{"id": "#);
        roots.write_docker_raw(ID_B, "{\"Name\": 7}");
        roots.write_docker_raw(ID_A, "\0\0\0");
        let mut names = roots.names(EAGER);
        assert_eq!(names.name(Runtime::Podman, ID_A), None);
        assert_eq!(names.name(Runtime::Podman, ID_A), None);
        assert_eq!(names.name(Runtime::Docker, ID_B), None);
        assert_eq!(names.name(Runtime::Docker, ID_A), None);
        // Logged once per file version (podman) or container (Docker).
        assert_eq!(names.podman.warned_stamp, names.podman.read_stamp);
        assert!(matches!(
            names.docker.get(ID_B),
            Some(DockerEntry::Unnamed { warned: true, .. })
        ));

        // Fixed by the runtime: names come back.
        roots.write_podman(&[(ID_A, "api")]);
        roots.write_docker(ID_B, "web");
        assert_eq!(names.name(Runtime::Podman, ID_A).as_deref(), Some("api"));
        assert_eq!(names.name(Runtime::Docker, ID_B).as_deref(), Some("web"));
    }

    #[test]
    fn entries_without_names_and_empty_names_are_absent() {
        let roots = Roots::new();
        roots.write_podman_raw(&format!(
            r#"[{{"id":"{ID_A}"}},{{"id":"{ID_B}","names":[]}}]"#
        ));
        roots.write_docker_raw(ID_A, r#"{"Name":"/"}"#);
        roots.write_docker_raw(ID_B, r#"{"ID":"x"}"#);
        let mut names = roots.names(EAGER);
        assert_eq!(names.name(Runtime::Podman, ID_A), None);
        assert_eq!(names.name(Runtime::Podman, ID_B), None);
        assert_eq!(names.name(Runtime::Docker, ID_A), None);
        assert_eq!(names.name(Runtime::Docker, ID_B), None);
    }

    #[test]
    fn oversized_files_are_not_read() {
        let roots = Roots::new();
        let path = roots
            .podman
            .path()
            .join("overlay-containers/containers.json");
        let file = File::create(&path).expect("creating");
        // Sparse: no disk space used.
        file.set_len(MAX_FILE_BYTES + 1).expect("growing");
        assert!(matches!(
            read_podman_file(&path, MAX_ENTRIES),
            Err(StateFileError::TooLarge(_))
        ));
        let mut names = roots.names(EAGER);
        assert_eq!(names.name(Runtime::Podman, ID_A), None);
    }

    #[test]
    fn caches_are_bounded() {
        let roots = Roots::new();
        let podman: Vec<(String, String)> = (0..10)
            .map(|n| (hex_id(n), format!("podman-{n}")))
            .collect();
        let podman_refs: Vec<(&str, &str)> = podman
            .iter()
            .map(|(id, name)| (id.as_str(), name.as_str()))
            .collect();
        roots.write_podman(&podman_refs);
        for n in 100..110 {
            roots.write_docker(&hex_id(n), &format!("docker-{n}"));
        }
        let limits = Limits {
            max_entries: 4,
            ..EAGER
        };
        let mut names = roots.names(limits);
        names.name(Runtime::Podman, &hex_id(0));
        assert_eq!(
            names.podman.by_id.len(),
            4,
            "podman's file read up to the cap"
        );
        for n in 100..110 {
            let id = hex_id(n);
            let expected = format!("docker-{n}");
            assert_eq!(
                names.name(Runtime::Docker, &id).as_deref(),
                Some(expected.as_str())
            );
            assert!(names.docker.len() <= 4);
        }
        // Missing ids are bounded too.
        for n in 200..220 {
            assert_eq!(names.name(Runtime::Docker, &hex_id(n)), None);
            assert!(names.docker.len() <= 4);
        }
        assert!(names.cached_entries() <= 8);
    }

    /// A real podman container's `--name`, from the host's containers-storage.
    #[test]
    #[ignore = "needs root and podman: run by `cargo xtask test`"]
    fn names_a_real_podman_container() {
        use crate::container::identify;
        use stackscope_test_fixtures::containers::{Container, Image, require_root};

        require_root();
        let image = Image::build("runtime-names", &[]);
        let container = Container::run(&image, "runtime-names", &["/bin/busybox", "sleep", "300"]);
        let identity = identify(&container.cgroup_path()).expect("a container cgroup");
        assert_eq!(identity.runtime, Runtime::Podman);
        assert_eq!(identity.container_id, container.id);
        let mut names = RuntimeNames::default();
        assert_eq!(
            names
                .name(identity.runtime, &identity.container_id)
                .as_deref(),
            Some(container.name.as_str())
        );
    }
}
