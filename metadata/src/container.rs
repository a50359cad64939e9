//! Which container, if any, a process runs in, from its cgroup path.
//!
//! Samples carry a pid; people query flamegraphs by container and pod. Every
//! mainstream runtime names the cgroup it creates after the container id, so
//! the path in `/proc/<pid>/cgroup` is enough to tell the runtime, the
//! 64-hex-digit container id, and under Kubernetes the pod UID and QoS class.
//! This module owns that mapping: [`cgroup_path_from_proc`] picks the path
//! out of the file's text, [`identify`] turns a path into a
//! [`ContainerIdentity`], and [`read_cgroup_path`] is the only I/O.
//!
//! It does not resolve pod names, namespaces or labels: those come from the
//! kubelet (or the runtime's API) elsewhere, later, keyed by the pod UID and
//! container id found here. It also does not follow cgroup ids from BPF to
//! paths; callers go through the pid.
//!
//! Recognised layouts (innermost matching component wins):
//!
//! | layout | example component(s) | runtime |
//! |---|---|---|
//! | Docker, cgroupfs driver | `/docker/<id>` | Docker |
//! | Docker, systemd driver | `docker-<id>.scope` | Docker |
//! | Kubernetes, cgroupfs driver | `/kubepods[/burstable\|/besteffort]/pod<uid>/<id>` | Containerd unless prefixed |
//! | Kubernetes, systemd driver | `kubepods-…-pod<uid_>.slice/{cri-containerd,crio,docker}-<id>.scope` | from the prefix |
//! | Podman, systemd manager | `libpod-<id>.scope`, `libpod-<id>.scope/container` | Podman |
//! | Podman, cgroupfs manager | `/libpod_parent/libpod-<id>` | Podman |
//! | nerdctl, systemd manager | `nerdctl-<id>.scope` | Containerd |
//!
//! Not recognised, on purpose: containerd's own cgroupfs layout for
//! `ctr`/nerdctl (`/<namespace>/<id>`), because a namespace directory is
//! indistinguishable from any other parent and `ctr` ids are free-form; and
//! container monitors (`crio-conmon-<id>.scope`, `libpod-conmon-<id>.scope`,
//! `/libpod_parent/conmon`), which are not the container's own code and are
//! reported as host processes.

use std::fmt;
use std::io;
use std::path::Path;

/// The container runtime that created a container's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Runtime {
    /// Docker (dockerd + containerd + runc), or Kubernetes via cri-dockerd.
    Docker,
    /// containerd through its CRI plugin (Kubernetes) or nerdctl.
    Containerd,
    /// CRI-O.
    CriO,
    /// Podman (libpod).
    Podman,
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Runtime::Docker => "docker",
            Runtime::Containerd => "containerd",
            Runtime::CriO => "cri-o",
            Runtime::Podman => "podman",
        })
    }
}

/// A Kubernetes pod's quality-of-service class, as the kubelet encodes it in
/// the cgroup hierarchy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QosClass {
    /// Requests equal limits for every container; the kubelet puts these
    /// pods directly under `kubepods` with no QoS level in between.
    Guaranteed,
    /// Some requests below limits: under `kubepods/burstable`.
    Burstable,
    /// No requests or limits at all: under `kubepods/besteffort`.
    BestEffort,
}

impl fmt::Display for QosClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QosClass::Guaranteed => "guaranteed",
            QosClass::Burstable => "burstable",
            QosClass::BestEffort => "besteffort",
        })
    }
}

/// What a cgroup path says about the container a process runs in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ContainerIdentity {
    /// The runtime that created the container's cgroup.
    pub runtime: Runtime,
    /// The full container id: 64 lower-case hex digits, as the runtime shows
    /// it (`docker ps --no-trunc`, `crictl ps`, `podman ps --no-trunc`).
    pub container_id: String,
    /// The Kubernetes pod UID in its API form (with dashes, e.g.
    /// `0b9d4c5e-1a2b-4c3d-9e8f-001122334455`; static pods have 32 hex
    /// digits without dashes), when the container belongs to a pod.
    pub pod_uid: Option<String>,
    /// The pod's QoS class, when the container belongs to a pod.
    pub qos: Option<QosClass>,
}

/// The cgroup path of a process from the text of `/proc/<pid>/cgroup`.
///
/// Each line is `hierarchy-id:controllers:path`. The v2 entry (`0::/path`)
/// is used when present (unified or hybrid hosts), else the v1 hierarchy
/// most likely to carry container paths: `cpu` (alone or as `cpu,cpuacct`),
/// then `memory`, then `pids`, then `name=systemd`, then any other.
///
/// One exception to "v2 first": on a hybrid host, a runtime that only
/// manages v1 hierarchies leaves the process at the unified root (`0::/`)
/// while the v1 controllers carry the container path (podman's cgroupfs
/// manager does this for conmon, older runc for containers), so a root v2
/// entry loses to a non-root v1 one. Likewise, among v1 lines a non-root
/// path beats a more preferred controller showing `/`.
///
/// A trailing ` (deleted)`, which the kernel appends when the cgroup was
/// removed while the process still sat in it, is stripped: the path still
/// names the container. Returns `None` for empty or unparseable text.
pub fn cgroup_path_from_proc(text: &str) -> Option<&str> {
    let mut v2: Option<&str> = None;
    // (non-root, preference) of the best v1 line so far; higher wins.
    let mut best_v1: Option<((bool, u8), &str)> = None;
    for line in text.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = path.strip_suffix(" (deleted)").unwrap_or(path);
        // Anything else is not a cgroup path (garbage, or a truncated read).
        if !path.starts_with('/') || id.parse::<u32>().is_err() {
            continue;
        }
        if id == "0" && controllers.is_empty() {
            v2 = Some(path);
            continue;
        }
        let rank = (path != "/", v1_preference(controllers));
        if best_v1.is_none_or(|(best, _)| rank > best) {
            best_v1 = Some((rank, path));
        }
    }
    match (v2, best_v1) {
        (Some("/"), Some(((true, _), v1))) => Some(v1),
        (Some(v2), _) => Some(v2),
        (None, Some((_, v1))) => Some(v1),
        (None, None) => None,
    }
}

/// How likely a v1 hierarchy is to carry the container path: every runtime
/// puts containers in a `cpu` cgroup (it enforces CPU limits there), most in
/// `memory` and `pids`; `name=systemd` mirrors systemd's units, which is right
/// for the systemd drivers only.
fn v1_preference(controllers: &str) -> u8 {
    let has = |name: &str| controllers.split(',').any(|c| c == name);
    if has("cpu") {
        4
    } else if has("memory") {
        3
    } else if has("pids") {
        2
    } else if has("name=systemd") {
        1
    } else {
        0
    }
}

/// Reads the cgroup path of process `pid` from `<proc_root>/<pid>/cgroup`.
///
/// `proc_root` is normally `/proc`; tests and agents running in a container
/// with the host's procfs mounted elsewhere pass another root. I/O errors
/// pass through; a process that has exited yields
/// [`io::ErrorKind::NotFound`] (the kernel answers `ESRCH` instead of
/// `ENOENT` when the process exits between open and read, which is mapped
/// here so callers have one case to handle). Text without a usable line is
/// [`io::ErrorKind::InvalidData`].
pub fn read_cgroup_path(proc_root: &Path, pid: u32) -> io::Result<String> {
    let file = proc_root.join(pid.to_string()).join("cgroup");
    let text = std::fs::read_to_string(&file).map_err(|e| {
        if e.raw_os_error() == Some(libc::ESRCH) {
            io::Error::new(io::ErrorKind::NotFound, e)
        } else {
            e
        }
    })?;
    cgroup_path_from_proc(&text)
        .map(str::to_owned)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("no cgroup path in {}", file.display()),
            )
        })
}

/// The container a cgroup path belongs to, or `None` for host processes.
///
/// Looks at the innermost path component that names a container, so nested
/// cgroups below a container (podman's `libpod-<id>.scope/container` with
/// `--cgroups=split`, systemd-in-a-container's `init.scope` and services)
/// resolve to the enclosing container, and a container nested in another
/// (Docker-in-Docker, kind nodes) to the inner one. If that innermost
/// component is a container monitor (conmon), the process is not in the
/// container and the answer is `None`.
///
/// The runtime comes from the component's prefix (`docker-`, `crio-`,
/// `cri-containerd-`, `libpod-`, `nerdctl-`). A bare id has none: below a
/// `docker` directory it is Docker's cgroupfs driver; below `kubepods` it is
/// taken to be containerd, the default CRI runtime since dockershim's removal
/// and the only cgroupfs-driver runtime that writes bare ids (CRI-O writes
/// `crio-<id>`; cri-dockerd's ids are also bare, so Docker-backed nodes with
/// the cgroupfs driver are misreported as containerd). A bare id anywhere
/// else is not trusted to be a container.
///
/// Ids must be exactly 64 lower-case hex digits; anything else is `None`.
pub fn identify(cgroup_path: &str) -> Option<ContainerIdentity> {
    let components: Vec<&str> = cgroup_path.split('/').filter(|c| !c.is_empty()).collect();
    let (index, found) = components
        .iter()
        .enumerate()
        .rev()
        .find_map(|(i, c)| classify(c).map(|found| (i, found)))?;
    let ancestors = &components[..index];
    let (runtime, id) = match found {
        Component::Monitor => return None,
        Component::Container(runtime, id) => (runtime, id),
        Component::BareId(id) => {
            let runtime = if ancestors.last() == Some(&"docker") {
                Runtime::Docker
            } else if ancestors.iter().any(|c| is_kubepods(c)) {
                Runtime::Containerd
            } else {
                return None;
            };
            (runtime, id)
        }
    };
    let (pod_uid, qos) = pod_of(ancestors);
    Some(ContainerIdentity {
        runtime,
        container_id: id.to_owned(),
        pod_uid,
        qos,
    })
}

/// What a single path component says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Component<'a> {
    /// A runtime-prefixed container cgroup.
    Container(Runtime, &'a str),
    /// A bare id, whose runtime depends on where it sits.
    BareId(&'a str),
    /// A container monitor's cgroup: innermost, but not a container.
    Monitor,
}

/// Prefixes runtimes put before the id. The systemd drivers add `.scope`;
/// the cgroupfs variants (podman's `libpod-<id>`, CRI-O's `crio-<id>`) don't.
const PREFIXES: &[(&str, Runtime)] = &[
    ("docker-", Runtime::Docker),
    ("cri-containerd-", Runtime::Containerd),
    ("crio-", Runtime::CriO),
    ("libpod-", Runtime::Podman),
    ("nerdctl-", Runtime::Containerd),
];

/// Prefixes of the conmon monitors' cgroups, checked before [`PREFIXES`]
/// because `crio-conmon-<id>` also starts with `crio-`.
const MONITOR_PREFIXES: &[&str] = &["crio-conmon-", "libpod-conmon-"];

fn classify(component: &str) -> Option<Component<'_>> {
    // podman's cgroupfs manager puts every conmon in one shared cgroup.
    if component == "conmon" {
        return Some(Component::Monitor);
    }
    let name = component.strip_suffix(".scope").unwrap_or(component);
    if MONITOR_PREFIXES
        .iter()
        .any(|p| name.strip_prefix(p).is_some_and(is_container_id))
    {
        return Some(Component::Monitor);
    }
    for &(prefix, runtime) in PREFIXES {
        if let Some(id) = name.strip_prefix(prefix).filter(|id| is_container_id(id)) {
            return Some(Component::Container(runtime, id));
        }
    }
    // A bare id is never a systemd unit, so `.scope` must not have been there.
    if name.len() == component.len() && is_container_id(component) {
        return Some(Component::BareId(component));
    }
    None
}

/// 64 lower-case hex digits: a full sha256-style id. Upper case is rejected
/// because no runtime writes it, so such a path is not one of theirs.
fn is_container_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `kubepods` (cgroupfs driver) or a `…kubepods….slice` (systemd driver,
/// including kind's `kubelet-kubepods.slice` under a custom cgroup root).
fn is_kubepods(component: &str) -> bool {
    component == "kubepods"
        || component
            .strip_suffix(".slice")
            .is_some_and(|s| s.contains("kubepods"))
}

/// Pod UID and QoS class from the ancestors of a container's cgroup, when
/// they lie below a `kubepods` root.
fn pod_of(ancestors: &[&str]) -> (Option<String>, Option<QosClass>) {
    let Some(root) = ancestors.iter().position(|c| is_kubepods(c)) else {
        return (None, None);
    };
    let below = &ancestors[root..];
    let Some(uid) = below.iter().rev().find_map(|c| pod_uid(c)) else {
        return (None, None);
    };
    let qos = below
        .iter()
        .find_map(|c| qos_of(c))
        // The kubelet gives guaranteed pods no QoS level of their own.
        .unwrap_or(QosClass::Guaranteed);
    (Some(uid), Some(qos))
}

fn qos_of(component: &str) -> Option<QosClass> {
    // cgroupfs: a bare `burstable` directory; systemd: `kubepods-burstable.slice`.
    let level = match component.strip_suffix(".slice") {
        Some(name) => name.rsplit_once('-')?.1,
        None => component,
    };
    match level {
        "burstable" => Some(QosClass::Burstable),
        "besteffort" => Some(QosClass::BestEffort),
        _ => None,
    }
}

/// The pod UID in a `pod<uid>` (cgroupfs) or `…-pod<uid_with_underscores>.slice`
/// (systemd; systemd reserves `-` for nesting, so the kubelet swaps the UID's
/// dashes for underscores) component, in the API's dashed form.
fn pod_uid(component: &str) -> Option<String> {
    let raw = match component.strip_suffix(".slice") {
        Some(name) => name.rsplit_once("-pod")?.1,
        None => component.strip_prefix("pod")?,
    };
    let uid = raw.replace('_', "-");
    is_pod_uid(&uid).then_some(uid)
}

/// A UUID (8-4-4-4-12 lower-case hex) as the API server assigns, or the 32
/// hex digits of the hash the kubelet uses as UID for static pods.
fn is_pod_uid(uid: &str) -> bool {
    let hex = |b: u8| matches!(b, b'0'..=b'9' | b'a'..=b'f');
    let bytes = uid.as_bytes();
    match bytes.len() {
        32 => bytes.iter().all(|&b| hex(b)),
        36 => bytes.iter().enumerate().all(|(i, &b)| {
            if matches!(i, 8 | 13 | 18 | 23) {
                b == b'-'
            } else {
                hex(b)
            }
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "ecbe4b0a677a5e4f1affbbd99da445ba0e00b6ecca79f30f291e16136a1f7d29";
    const UID: &str = "0b9d4c5e-1a2b-4c3d-9e8f-001122334455";
    const UID_: &str = "0b9d4c5e_1a2b_4c3d_9e8f_001122334455";

    fn container(runtime: Runtime) -> ContainerIdentity {
        ContainerIdentity {
            runtime,
            container_id: ID.to_owned(),
            pod_uid: None,
            qos: None,
        }
    }

    fn pod(runtime: Runtime, qos: QosClass) -> ContainerIdentity {
        ContainerIdentity {
            runtime,
            container_id: ID.to_owned(),
            pod_uid: Some(UID.to_owned()),
            qos: Some(qos),
        }
    }

    /// Every path used in the tests, with `{id}`, `{uid}`, `{uid_}` filled in,
    /// and what `identify` must say about it.
    fn cases() -> Vec<(String, Option<ContainerIdentity>)> {
        use QosClass::*;
        use Runtime::*;
        let raw: Vec<(&str, Option<ContainerIdentity>)> = vec![
            // Docker, cgroupfs and systemd drivers.
            ("/docker/{id}", Some(container(Docker))),
            ("/system.slice/docker-{id}.scope", Some(container(Docker))),
            // systemd running inside a Docker container (cgroup v2).
            (
                "/system.slice/docker-{id}.scope/init.scope",
                Some(container(Docker)),
            ),
            (
                "/system.slice/docker-{id}.scope/system.slice/cron.service",
                Some(container(Docker)),
            ),
            // Kubernetes, cgroupfs driver.
            (
                "/kubepods/burstable/pod{uid}/{id}",
                Some(pod(Containerd, Burstable)),
            ),
            (
                "/kubepods/besteffort/pod{uid}/{id}",
                Some(pod(Containerd, BestEffort)),
            ),
            ("/kubepods/pod{uid}/{id}", Some(pod(Containerd, Guaranteed))),
            (
                "/kubepods/burstable/pod{uid}/crio-{id}",
                Some(pod(CriO, Burstable)),
            ),
            (
                "/kubepods/besteffort/pod{uid}/docker-{id}",
                Some(pod(Docker, BestEffort)),
            ),
            (
                "/kubepods/pod{uid}/cri-containerd-{id}",
                Some(pod(Containerd, Guaranteed)),
            ),
            // Kubernetes, systemd driver.
            (
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{id}.scope",
                Some(pod(Containerd, Burstable)),
            ),
            (
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/crio-{id}.scope",
                Some(pod(CriO, Burstable)),
            ),
            (
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/docker-{id}.scope",
                Some(pod(Docker, BestEffort)),
            ),
            (
                "/kubepods.slice/kubepods-pod{uid_}.slice/cri-containerd-{id}.scope",
                Some(pod(Containerd, Guaranteed)),
            ),
            (
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/crio-{id}.scope",
                Some(pod(CriO, BestEffort)),
            ),
            // CRI-O's conmon monitor is not the container.
            (
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/crio-conmon-{id}.scope",
                None,
            ),
            // kind: a Kubernetes node inside a Docker container, custom cgroup root.
            (
                "/system.slice/docker-{id}.scope/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{uid_}.slice/cri-containerd-{id}.scope",
                Some(pod(Containerd, Burstable)),
            ),
            // Podman, systemd manager, with and without --cgroups=split.
            ("/machine.slice/libpod-{id}.scope", Some(container(Podman))),
            (
                "/machine.slice/libpod-{id}.scope/container",
                Some(container(Podman)),
            ),
            ("/machine.slice/libpod-conmon-{id}.scope", None),
            // Podman, cgroupfs manager (seen live with podman 4.3.1 + runc).
            ("/libpod_parent/libpod-{id}", Some(container(Podman))),
            ("/libpod_parent/conmon", None),
            // nerdctl, systemd manager.
            (
                "/system.slice/nerdctl-{id}.scope",
                Some(container(Containerd)),
            ),
            // Host processes.
            ("/", None),
            ("", None),
            ("/user.slice/user-0.slice/session-1.scope", None),
            ("/system.slice/sshd.service", None),
            ("/system.slice/containerd.service", None),
            ("/init.scope", None),
            // A bare id outside docker/kubepods: runtime unknown, not trusted.
            ("/default/{id}", None),
            // Malformed ids.
            ("/docker/{id}0", None),
            ("/system.slice/docker-{short}.scope", None),
            ("/system.slice/docker-{upper}.scope", None),
            ("/docker/{nonhex}", None),
            ("/docker/{id}.scope", None),
            ("/kubepods/burstable/pod{uid}/{upper}", None),
            // A malformed pod UID keeps the container, drops the pod.
            (
                "/kubepods/burstable/podnot-a-uid/{id}",
                Some(container(Containerd)),
            ),
        ];
        let short = &ID[..63];
        let upper = ID.to_uppercase();
        let nonhex = format!("{}g", &ID[..63]);
        raw.into_iter()
            .map(|(p, want)| {
                let p = p
                    .replace("{uid_}", UID_)
                    .replace("{uid}", UID)
                    .replace("{id}", ID)
                    .replace("{short}", short)
                    .replace("{upper}", &upper)
                    .replace("{nonhex}", &nonhex);
                (p, want)
            })
            .collect()
    }

    #[test]
    fn identifies_every_layout() {
        for (path, want) in cases() {
            assert_eq!(identify(&path), want, "{path}");
        }
    }

    #[test]
    fn static_pod_uid_without_dashes() {
        let uid = "4a1f0bd8f8d6cd4d6d2a9b3e7c1f4e2a";
        let path = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/cri-containerd-{ID}.scope"
        );
        let got = identify(&path).unwrap();
        assert_eq!(got.pod_uid.as_deref(), Some(uid));
        assert_eq!(got.qos, Some(QosClass::Burstable));
    }

    #[test]
    fn innermost_container_wins() {
        let inner = "1".repeat(64);
        let got = identify(&format!("/docker/{ID}/docker/{inner}")).unwrap();
        assert_eq!(got.container_id, inner);
        assert_eq!(got.runtime, Runtime::Docker);
    }

    #[test]
    fn display_names() {
        assert_eq!(Runtime::Docker.to_string(), "docker");
        assert_eq!(Runtime::Containerd.to_string(), "containerd");
        assert_eq!(Runtime::CriO.to_string(), "cri-o");
        assert_eq!(Runtime::Podman.to_string(), "podman");
        assert_eq!(QosClass::Guaranteed.to_string(), "guaranteed");
        assert_eq!(QosClass::Burstable.to_string(), "burstable");
        assert_eq!(QosClass::BestEffort.to_string(), "besteffort");
    }

    #[test]
    fn proc_pure_v2() {
        let text = format!("0::/system.slice/docker-{ID}.scope\n");
        let want = format!("/system.slice/docker-{ID}.scope");
        assert_eq!(cgroup_path_from_proc(&text), Some(want.as_str()));
    }

    #[test]
    fn proc_v1_prefers_cpu() {
        let text = format!(
            "12:hugetlb:/docker/{ID}\n\
             11:memory:/docker/{ID}\n\
             10:pids:/docker/{ID}\n\
             9:cpu,cpuacct:/docker/{ID}\n\
             8:net_cls,net_prio:/\n\
             1:name=systemd:/docker/{ID}\n"
        );
        let want = format!("/docker/{ID}");
        assert_eq!(cgroup_path_from_proc(&text), Some(want.as_str()));
        // `cpu` alone beats `memory`; order in the file does not matter.
        let text = "4:memory:/m\n2:cpuacct:/a\n1:cpu:/c\n";
        assert_eq!(cgroup_path_from_proc(text), Some("/c"));
        let text = "9:name=systemd:/s\n8:pids:/p\n4:memory:/m\n";
        assert_eq!(cgroup_path_from_proc(text), Some("/m"));
        let text = "9:name=systemd:/s\n8:pids:/p\n";
        assert_eq!(cgroup_path_from_proc(text), Some("/p"));
        let text = "9:name=systemd:/s\n7:blkio:/b\n";
        assert_eq!(cgroup_path_from_proc(text), Some("/s"));
        let text = "7:blkio:/b\n";
        assert_eq!(cgroup_path_from_proc(text), Some("/b"));
        // A non-root path beats a preferred controller at the root.
        let text = "1:cpu:/\n4:memory:/x\n";
        assert_eq!(cgroup_path_from_proc(text), Some("/x"));
    }

    #[test]
    fn proc_hybrid_prefers_v2() {
        // As podman 4.3.1 (cgroupfs manager, runc) shows it on a hybrid host,
        // except for the v2 line's trailing `/`, there to tell which line won.
        let text = [
            "9:name=systemd:/libpod_parent/libpod-{id}",
            "8:pids:/libpod_parent/libpod-{id}",
            "4:memory:/libpod_parent/libpod-{id}",
            "2:cpuacct:/libpod_parent/libpod-{id}",
            "1:cpu:/libpod_parent/libpod-{id}",
            "0::/libpod_parent/libpod-{id}/",
        ]
        .join("\n")
        .replace("{id}", ID);
        let got = cgroup_path_from_proc(&text).unwrap();
        assert!(got.ends_with('/'), "took the v2 line: {got}");
        assert_eq!(identify(got), Some(container(Runtime::Podman)));
    }

    #[test]
    fn proc_hybrid_root_v2_falls_back_to_v1() {
        // podman's conmon (cgroupfs manager) on a hybrid host: v1 only.
        let text = "9:name=systemd:/\n8:pids:/libpod_parent/conmon\n\
                    1:cpu:/libpod_parent/conmon\n0::/\n";
        assert_eq!(cgroup_path_from_proc(text), Some("/libpod_parent/conmon"));
        // All at the root: the root.
        let text = "1:cpu:/\n0::/\n";
        assert_eq!(cgroup_path_from_proc(text), Some("/"));
    }

    #[test]
    fn proc_deleted_suffix() {
        let text = format!("0::/system.slice/docker-{ID}.scope (deleted)\n");
        let got = cgroup_path_from_proc(&text).unwrap();
        assert_eq!(identify(got), Some(container(Runtime::Docker)));
    }

    #[test]
    fn proc_garbage() {
        for text in [
            "",
            "\n\n",
            "garbage",
            "0:",
            "0::",
            "0::relative",
            "x::/a",
            "1:cpu",
            "\u{0}\u{ff}:::",
        ] {
            assert_eq!(cgroup_path_from_proc(text), None, "{text:?}");
        }
    }

    #[test]
    fn read_from_proc_root() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("42")).unwrap();
        std::fs::write(
            dir.path().join("42/cgroup"),
            format!("1:cpu:/\n0::/docker/{ID}\n"),
        )
        .unwrap();
        assert_eq!(
            read_cgroup_path(dir.path(), 42).unwrap(),
            format!("/docker/{ID}")
        );
        let missing = read_cgroup_path(dir.path(), 43).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
        std::fs::create_dir(dir.path().join("44")).unwrap();
        std::fs::write(dir.path().join("44/cgroup"), "junk\n").unwrap();
        let junk = read_cgroup_path(dir.path(), 44).unwrap_err();
        assert_eq!(junk.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn read_own_cgroup() {
        // Whatever this host is, our own process has a cgroup path.
        let path = read_cgroup_path(Path::new("/proc"), std::process::id()).unwrap();
        assert!(path.starts_with('/'), "{path}");
    }

    #[test]
    fn never_panics() {
        let mut inputs: Vec<String> = Vec::new();
        for (path, _) in cases() {
            for (i, _) in path.char_indices() {
                inputs.push(path[..i].to_owned());
                inputs.push(path[i..].to_owned());
            }
        }
        // Seeded: deterministic, so a failure reproduces.
        use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
        let mut next = move || rng.random::<u64>();
        // Random bytes, and random words from the alphabet the parser
        // actually looks at so the deeper branches are reached.
        let words = [
            "/",
            "-",
            "_",
            ".scope",
            ".slice",
            "pod",
            "kubepods",
            "docker",
            "crio-",
            "conmon-",
            "libpod-",
            "burstable",
            "besteffort",
            "a",
            "0",
            ID,
            UID,
            UID_,
            "é",
            "\u{0}",
        ];
        for _ in 0..5000 {
            let len = (next() % 40) as usize;
            let bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            inputs.push(String::from_utf8_lossy(&bytes).into_owned());
            let n = (next() % 12) as usize;
            let s: String = (0..n)
                .map(|_| words[(next() % words.len() as u64) as usize])
                .collect();
            inputs.push(s);
        }
        for input in &inputs {
            if let Some(got) = identify(input) {
                assert!(is_container_id(&got.container_id), "{input:?}");
            }
            let _ = cgroup_path_from_proc(input);
            let _ = cgroup_path_from_proc(&format!("0::{input}\n1:cpu:{input}"));
        }
    }
}
