//! The manifests in `deploy/` (root, real BPF, real podman).
//!
//! The capability test runs the agent binary with exactly the capabilities
//! the DaemonSet grants, then with each one taken away: every one must be
//! needed (something fails or degrades without it), and together they must
//! be enough (another user's process, its binary in a directory only that
//! user may search, unwound to the root; kernel frames named).
//!
//! The pod test runs the collector's StatefulSet pod with `podman kube
//! play` and the agent's DaemonSet pod, from the images `cargo xtask image`
//! built, with the manifests' capabilities, security settings and mounts.
//! Both pods are derived from the manifests here (podman plays Pods, not
//! DaemonSets or StatefulSets), changed only where podman or this machine
//! needs it: host networking (no cluster network: the agent reaches the
//! collector on 127.0.0.1), free ports, temporary directories for the host
//! paths and the volume claim, the values the kubelet would give the
//! downward-API variables (podman 4.3 resolves neither `spec.nodeName` nor
//! `status.hostIP`), and the agent's sampling rate and interval. The
//! agent's pod is translated field by field to `podman run`, because
//! Debian 12's podman (4.3) plays every pod in a private pid namespace,
//! `hostPID` or not ([`RunPod`]). The agent profiles a fixture on the host
//! and one in another container; both arrive with their chains and labels;
//! SIGTERM ends the agent with its last interval delivered and no BPF
//! program left behind.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use stackscope_test_fixtures::{
    C_FLAGS, Fixture, RunningProcess,
    containers::{Container, Image, podman},
};
use stackscope_tests::{exclusive, folded, free_port, http_get, require_root, workspace_binary};
use yaml_serde::Value;

/// The tags `cargo xtask image` gives the images (and the manifests use).
const AGENT_IMAGE: &str = "localhost/stackscope-agent:0.1.0";
const COLLECTOR_IMAGE: &str = "localhost/stackscope-collector:0.1.0";

/// The collector's user in its image and manifest.
const COLLECTOR_UID: u32 = 65532;

/// A user with no rights of its own, for processes the agent profiles.
const NOBODY: u32 = 65534;

fn manifest(relative: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(relative);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("reading {}: {err}", path.display()));
    yaml_serde::from_str(&text).unwrap_or_else(|err| panic!("parsing {}: {err}", path.display()))
}

/// The first container of a workload's pod template.
fn first_container(template_spec: &Value) -> &Value {
    &template_spec["containers"][0]
}

/// The capabilities the DaemonSet adds, as written (`BPF`, `SYS_PTRACE`).
fn granted_capabilities() -> Vec<String> {
    let daemonset = manifest("agent/daemonset.yaml");
    let security = &first_container(&daemonset["spec"]["template"]["spec"])["securityContext"];
    assert_eq!(
        security["capabilities"]["drop"][0].as_str(),
        Some("ALL"),
        "the agent must drop every capability it does not add"
    );
    assert_eq!(security["privileged"].as_bool(), Some(false));
    security["capabilities"]["add"]
        .as_sequence()
        .expect("capabilities.add")
        .iter()
        .map(|cap| cap.as_str().expect("a capability name").to_string())
        .collect()
}

/// What one agent run achieved.
#[derive(Debug)]
struct Outcome {
    /// The agent exited successfully.
    ran: bool,
    walks: u64,
    outermost: u64,
    kernel_named: u64,
    error: String,
}

impl Outcome {
    fn complete(&self) -> bool {
        self.ran
            && self.walks >= 100
            && self.outermost * 10 >= self.walks * 9
            && self.kernel_named > 0
    }
}

/// Runs the agent on `pid` for 3 s with only `caps` (setpriv's names:
/// `bpf`, `sys_ptrace`) in its bounding set: as root, those become its
/// permitted and effective capabilities at exec.
fn run_with_capabilities(pid: u32, caps: &[String]) -> Outcome {
    let bounding: String = std::iter::once("-all".to_string())
        .chain(caps.iter().map(|cap| format!("+{cap}")))
        .collect::<Vec<_>>()
        .join(",");
    let out = Command::new("setpriv")
        .args(["--bounding-set", &bounding, "--inh-caps", "-all", "--"])
        .arg(workspace_binary("stackscope-agent"))
        .args(["--pid", &pid.to_string(), "--frequency", "199"])
        .args(["--duration", "3s", "--no-table-cache", "--json"])
        .args(["--log-level", "warn"])
        .output()
        .expect("running setpriv");
    let error = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let Ok(report) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
        return Outcome {
            ran: false,
            walks: 0,
            outermost: 0,
            kernel_named: 0,
            error,
        };
    };
    let count = |value: &serde_json::Value| value.as_u64().unwrap_or(0);
    Outcome {
        ran: out.status.success(),
        walks: count(&report["unwinding"]["walks"]),
        outermost: count(&report["unwinding"]["outermost"]),
        kernel_named: count(&report["symbolization"]["counts"]["kernel_named"]),
        error,
    }
}

#[test]
fn the_daemonset_grants_exactly_the_capabilities_the_agent_needs() {
    require_root();
    let _serial = exclusive();
    // Another user's process (so reading its memory and maps needs
    // SYS_PTRACE), its binary in a directory only that user may search (so
    // reading it needs DAC_READ_SEARCH), spending its time in read(2) (so
    // its samples have kernel frames to name).
    let fixture = Fixture::compile("syscall_loop", C_FLAGS);
    let private = tempfile::tempdir().expect("temp dir");
    let binary = private.path().join("syscall_loop");
    std::fs::copy(&fixture.path, &binary).expect("copying the fixture");
    for path in [private.path(), binary.as_path()] {
        std::os::unix::fs::chown(path, Some(NOBODY), Some(NOBODY)).expect("chown");
    }
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700))
        .expect("chmod 0700");
    let nobody = NOBODY.to_string();
    let spinner = RunningProcess::start_ready(
        Command::new("setpriv")
            .args(["--reuid", &nobody, "--regid", &nobody, "--clear-groups"])
            .arg(&binary),
    );

    let granted: Vec<String> = granted_capabilities()
        .iter()
        .map(|cap| cap.to_lowercase())
        .collect();
    let all = run_with_capabilities(spinner.pid(), &granted);
    assert!(
        all.complete(),
        "with the DaemonSet's capabilities {granted:?} the agent falls short \
         (a capability is missing from the manifest): {all:?}"
    );

    // kallsyms shows addresses without SYSLOG when perf_event_paranoid <= 1.
    let paranoid: i32 = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
        .expect("reading perf_event_paranoid")
        .trim()
        .parse()
        .expect("a number");
    for cap in &granted {
        if cap == "syslog" && paranoid <= 1 {
            eprintln!("perf_event_paranoid is {paranoid}: SYSLOG is not needed on this host");
            continue;
        }
        let without: Vec<String> = granted.iter().filter(|c| *c != cap).cloned().collect();
        let outcome = run_with_capabilities(spinner.pid(), &without);
        assert!(
            !outcome.complete(),
            "the DaemonSet grants {cap} but the agent does as well without it: {outcome:?}"
        );
        let why = outcome
            .error
            .lines()
            .find(|line| line.starts_with("Error"))
            .unwrap_or_default();
        eprintln!(
            "without {cap}: ran {}, {} of {} walks to the root, {} kernel frames named {why}",
            outcome.ran, outcome.outermost, outcome.walks, outcome.kernel_named
        );
    }
}

/// A pod played with `podman kube play`, removed on drop.
struct PlayedPod {
    name: String,
    _file: tempfile::NamedTempFile,
}

impl PlayedPod {
    fn play(pod: &Value) -> Self {
        let name = pod["metadata"]["name"]
            .as_str()
            .expect("a pod name")
            .to_string();
        let mut file = tempfile::Builder::new()
            .suffix(".yaml")
            .tempfile()
            .expect("temp file");
        std::io::Write::write_all(
            &mut file,
            yaml_serde::to_string(pod).expect("pod YAML").as_bytes(),
        )
        .expect("writing the pod");
        // podman's default ulimits exceed this host's hard limits (see
        // PODMAN_RUN_FLAGS); kube play takes them from containers.conf only.
        let conf = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(
            conf.path(),
            "[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n",
        )
        .expect("writing containers.conf");
        let played = Self { name, _file: file };
        let out = podman()
            .env("CONTAINERS_CONF", conf.path())
            .args(["kube", "play"])
            .arg(played._file.path())
            .output()
            .expect("running podman kube play");
        assert!(
            out.status.success(),
            "podman kube play {} failed: {}",
            played.name,
            String::from_utf8_lossy(&out.stderr)
        );
        played
    }
}

impl Drop for PlayedPod {
    fn drop(&mut self) {
        let _ = podman().args(["pod", "rm", "-f", &self.name]).output();
    }
}

/// A one-container pod with `hostPID` run as `podman run`: podman 4.3
/// (Debian 12's) plays pods in a private pid namespace whatever `hostPID`
/// says (support came in 4.4), and an agent there sees none of the host's
/// processes. Every field of the pod is translated to its `podman run`
/// flag; a field this does not know fails the test, so the manifest cannot
/// grow a setting the test silently drops.
struct RunPod {
    container: String,
    /// `terminationGracePeriodSeconds`, for `podman stop --time`.
    grace_seconds: String,
}

impl RunPod {
    fn start(pod: &Value) -> Self {
        let name = pod["metadata"]["name"].as_str().expect("a pod name");
        let mut flags: Vec<String> = vec![
            "run".into(),
            "-d".into(),
            format!("--name={name}"),
            // As in PODMAN_RUN_FLAGS: podman's default ulimits exceed this
            // host's hard limits.
            "--ulimit=nofile=1024:1024".into(),
            "--ulimit=nproc=1024:1024".into(),
        ];
        let spec = pod["spec"].as_mapping().expect("a pod spec");
        let mut grace_seconds = "30".to_string();
        let mut volumes = std::collections::HashMap::new();
        for (key, value) in spec {
            match key.as_str().expect("a key") {
                "hostPID" if value.as_bool() == Some(true) => flags.push("--pid=host".into()),
                "hostNetwork" if value.as_bool() == Some(true) => {
                    flags.push("--network=host".into())
                }
                "terminationGracePeriodSeconds" => {
                    grace_seconds = value.as_u64().expect("seconds").to_string()
                }
                "restartPolicy" => assert_eq!(value.as_str(), Some("Never")),
                "volumes" => {
                    for volume in value.as_sequence().expect("volumes") {
                        let path = volume["hostPath"]["path"]
                            .as_str()
                            .expect("only hostPath volumes are translated");
                        volumes.insert(volume["name"].as_str().expect("a name"), path);
                    }
                }
                // Cluster-side settings with no meaning for one pod here.
                "serviceAccountName" | "tolerations" | "priorityClassName" => {}
                "containers" => {}
                other => panic!("the agent's pod has {other}: translate it to podman run"),
            }
        }
        let containers = spec["containers"].as_sequence().expect("containers");
        assert_eq!(containers.len(), 1, "one container");
        let container = containers[0].as_mapping().expect("a container");
        let mut image = None;
        let mut args = Vec::new();
        let mut env_values: Vec<(String, String)> = Vec::new();
        for (key, value) in container {
            match key.as_str().expect("a key") {
                "name" => {}
                "image" => image = value.as_str(),
                "args" => args.extend(
                    value
                        .as_sequence()
                        .expect("args")
                        .iter()
                        .map(|arg| arg.as_str().expect("a string").to_string()),
                ),
                "env" => {
                    for env in value.as_sequence().expect("env") {
                        let value = env["value"]
                            .as_str()
                            .expect("literal env values (downward API resolved)");
                        let name = env["name"].as_str().expect("a name");
                        flags.push(format!("--env={name}={value}"));
                        env_values.push((name.to_string(), value.to_string()));
                    }
                }
                "securityContext" => {
                    for (key, value) in value.as_mapping().expect("a security context") {
                        match key.as_str().expect("a key") {
                            "privileged" => assert_eq!(value.as_bool(), Some(false)),
                            "allowPrivilegeEscalation" if value.as_bool() == Some(false) => {
                                flags.push("--security-opt=no-new-privileges".into())
                            }
                            "readOnlyRootFilesystem" if value.as_bool() == Some(true) => {
                                flags.push("--read-only".into())
                            }
                            "runAsUser" => {
                                flags.push(format!("--user={}", value.as_u64().unwrap()))
                            }
                            "seccompProfile" => match value["type"].as_str() {
                                Some("Unconfined") => {
                                    flags.push("--security-opt=seccomp=unconfined".into())
                                }
                                Some("RuntimeDefault") => {}
                                other => panic!("seccomp profile {other:?}"),
                            },
                            "capabilities" => {
                                for cap in value["drop"].as_sequence().into_iter().flatten() {
                                    flags.push(format!("--cap-drop={}", cap.as_str().unwrap()));
                                }
                                for cap in value["add"].as_sequence().into_iter().flatten() {
                                    flags.push(format!("--cap-add={}", cap.as_str().unwrap()));
                                }
                            }
                            other => panic!("securityContext.{other}: translate it to podman run"),
                        }
                    }
                }
                "volumeMounts" => {
                    for mount in value.as_sequence().expect("volume mounts") {
                        let source = volumes[mount["name"].as_str().expect("a name")];
                        let target = mount["mountPath"].as_str().expect("a path");
                        let mode = if mount["readOnly"].as_bool() == Some(true) {
                            "ro"
                        } else {
                            "rw"
                        };
                        flags.push(format!("--volume={source}:{target}:{mode}"));
                    }
                }
                // Enforced by the kubelet, not by the container: the probes
                // are sent by the test itself.
                "ports" | "resources" | "livenessProbe" | "readinessProbe" => {}
                other => panic!("the agent's container has {other}: translate it to podman run"),
            }
        }
        flags.push(image.expect("an image").to_string());
        // `$(NAME)` in args is the container's variable, as the kubelet
        // expands it.
        flags.extend(args.into_iter().map(|mut arg| {
            for (name, value) in &env_values {
                arg = arg.replace(&format!("$({name})"), value);
            }
            arg
        }));
        let out = podman().args(&flags).output().expect("podman run");
        assert!(
            out.status.success(),
            "podman {flags:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self {
            container: name.to_string(),
            grace_seconds,
        }
    }
}

impl Drop for RunPod {
    fn drop(&mut self) {
        let _ = podman().args(["rm", "-f", &self.container]).output();
    }
}

/// A Pod from a workload's pod template, on the host network (without the
/// container ports it would publish), restarted never (a test runs it
/// once).
fn pod_from_template(workload: &Value, name: &str) -> Value {
    let template = &workload["spec"]["template"];
    let mut metadata = template["metadata"].clone();
    metadata["name"] = name.into();
    let mut spec = template["spec"].clone();
    spec["hostNetwork"] = true.into();
    // On the host network podman publishes no ports.
    for container in spec["containers"].as_sequence_mut().expect("containers") {
        if let Some(container) = container.as_mapping_mut() {
            container.remove("ports");
        }
    }
    spec["restartPolicy"] = "Never".into();
    let mut pod = yaml_serde::Mapping::new();
    pod.insert("apiVersion".into(), "v1".into());
    pod.insert("kind".into(), "Pod".into());
    pod.insert("metadata".into(), metadata);
    pod.insert("spec".into(), spec);
    Value::Mapping(pod)
}

/// Replaces the value of every `--flag=value` argument named in `values`,
/// and appends `extra`.
fn set_args(container: &mut Value, values: &[(&str, String)], extra: &[&str]) {
    let args = container["args"].as_sequence_mut().expect("args");
    for arg in args.iter_mut() {
        let text = arg.as_str().expect("a string argument").to_string();
        if let Some((flag, _)) = text.split_once('=')
            && let Some((_, value)) = values.iter().find(|(f, _)| *f == flag)
        {
            *arg = format!("{flag}={value}").into();
        }
    }
    args.extend(extra.iter().map(|&arg| Value::from(arg)));
}

/// Points the pod volume `name` at `host_dir`.
fn host_volume(pod: &mut Value, name: &str, host_dir: &Path) {
    let volumes = pod["spec"]["volumes"].as_sequence_mut().expect("volumes");
    let mut volume = yaml_serde::Mapping::new();
    volume.insert("name".into(), name.into());
    let mut host_path = yaml_serde::Mapping::new();
    host_path.insert("path".into(), host_dir.to_str().expect("UTF-8").into());
    host_path.insert("type".into(), "Directory".into());
    volume.insert("hostPath".into(), Value::Mapping(host_path));
    volumes.retain(|v| v["name"].as_str() != Some(name));
    volumes.push(Value::Mapping(volume));
}

/// Waits (up to 30 s) until `GET path` on `address` answers 200.
fn wait_ready(address: &str, path: &str) {
    let started = Instant::now();
    while http_get(address, path).map(|(status, _)| status) != Some(200) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{address}{path} never answered 200"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The value of an unlabelled metric `name` on `address`'s `/metrics`.
fn metric(address: &str, name: &str) -> f64 {
    stackscope_test_fixtures::metric(address, name)
        .unwrap_or_else(|| panic!("no {name} on {address}"))
}

/// A container's standard output, then its standard error.
fn logs(container: &str) -> String {
    let out = podman()
        .args(["logs", container])
        .output()
        .expect("podman logs");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn image_exists(tag: &str) -> bool {
    podman()
        .args(["image", "exists", tag])
        .status()
        .is_ok_and(|status| status.success())
}

#[test]
fn the_agent_daemonset_and_the_collector_run_as_pods_from_their_images() {
    require_root();
    let _serial = exclusive();
    for image in [AGENT_IMAGE, COLLECTOR_IMAGE] {
        assert!(
            image_exists(image),
            "{image} is missing: run `cargo xtask image` (cargo xtask test builds it)"
        );
    }
    let run_id = std::process::id();
    let node = format!("stackscope-test-node-{run_id}");

    // The collector: its volume claim becomes a directory its user owns.
    let data = tempfile::tempdir().expect("temp dir");
    std::os::unix::fs::chown(data.path(), Some(COLLECTOR_UID), Some(COLLECTOR_UID))
        .expect("chown the collector's data dir");
    let (grpc_port, http_port) = (free_port(), free_port());
    let statefulset = manifest("collector/statefulset.yaml");
    let mut collector_pod =
        pod_from_template(&statefulset, &format!("stackscope-test-collector-{run_id}"));
    set_args(
        &mut collector_pod["spec"]["containers"][0],
        &[
            ("--grpc-listen", format!("127.0.0.1:{grpc_port}")),
            ("--http-listen", format!("127.0.0.1:{http_port}")),
        ],
        &[],
    );
    collector_pod["spec"]["volumes"] = Value::Sequence(Vec::new());
    host_volume(&mut collector_pod, "data", data.path());
    let collector_http = format!("127.0.0.1:{http_port}");
    let collector_pod = PlayedPod::play(&collector_pod);
    wait_ready(&collector_http, "/readyz");
    let collector = CollectorAt {
        grpc: format!("http://127.0.0.1:{grpc_port}"),
    };

    // What the agent profiles: a fixture on the host, another in a
    // container of its own.
    let host_fixture = Fixture::compile("call_chain", C_FLAGS);
    let host_process = host_fixture.start(&[]);
    let contained = Fixture::compile("other_chain", &["-static"]);
    let image = Image::build("deploy", &[(contained.path.as_path(), "/app/other_chain")]);
    let container = Container::run(&image, "deployed", &["/app/other_chain"]);

    // The agent, from the DaemonSet's pod template.
    let cache = tempfile::tempdir().expect("temp dir");
    let metrics_port = free_port();
    let daemonset = manifest("agent/daemonset.yaml");
    let mut agent_pod = pod_from_template(&daemonset, &format!("stackscope-test-agent-{run_id}"));
    {
        let agent = &mut agent_pod["spec"]["containers"][0];
        set_args(
            agent,
            &[
                ("--collector", collector.grpc.clone()),
                ("--metrics-address", format!("127.0.0.1:{metrics_port}")),
            ],
            &["--frequency=199", "--interval=1s", "--json"],
        );
        // What the kubelet would put in the downward-API variables.
        for env in agent["env"].as_sequence_mut().expect("env") {
            let value = match env["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("spec.nodeName") => node.clone(),
                Some("status.hostIP") => "127.0.0.1".to_string(),
                Some(other) => panic!("no test value for the downward API field {other}"),
                None => continue,
            };
            let name = env["name"].clone();
            let mut literal = yaml_serde::Mapping::new();
            literal.insert("name".into(), name);
            literal.insert("value".into(), value.into());
            *env = Value::Mapping(literal);
        }
    }
    host_volume(&mut agent_pod, "table-cache", cache.path());
    let loaded_before = stackscope_tests::bpf_ids_loaded("prog");
    let agent_pod = RunPod::start(&agent_pod);
    let metrics = format!("127.0.0.1:{metrics_port}");
    wait_ready(&metrics, "/readyz");
    assert_eq!(http_get(&metrics, "/healthz").map(|(s, _)| s), Some(200));

    // Until both fixtures have arrived.
    let host_match = format!("node=\"{node}\",comm=\"call_chain\"");
    let container_match = format!("node=\"{node}\",container_id=\"{}\"", container.id);
    let started = Instant::now();
    while collector.total(&host_match) < 200 || collector.total(&container_match) < 200 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the fixtures did not arrive: host {}, container {}; the agent's log:\n{}",
            collector.total(&host_match),
            collector.total(&container_match),
            logs(&agent_pod.container),
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // What the note and the manifests' resources are made from.
    for (who, address) in [("agent", &metrics), ("collector", &collector_http)] {
        let peak = metric(address, "process_peak_resident_memory_bytes");
        let cpu = metric(address, "process_cpu_seconds_total");
        eprintln!(
            "{who} in its pod: peak RSS {:.1} MB, {cpu:.2} s of CPU in {:.1} s",
            peak / 1e6,
            started.elapsed().as_secs_f64()
        );
    }

    // SIGTERM, as the kubelet sends it (the image's STOPSIGNAL).
    let agent_container = agent_pod.container.clone();
    let out = podman()
        .args(["stop", "--time", &agent_pod.grace_seconds, &agent_container])
        .output()
        .expect("podman stop");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exit = podman()
        .args([
            "inspect",
            "--format",
            "{{.State.ExitCode}}",
            &agent_container,
        ])
        .output()
        .expect("podman inspect");
    assert_eq!(
        String::from_utf8_lossy(&exit.stdout).trim(),
        "0",
        "the agent's exit code"
    );
    let report: serde_json::Value = logs(&agent_container)
        .lines()
        .find_map(|line| serde_json::from_str(line).ok())
        .expect("the agent's JSON report in its log");
    // The last interval arrived: what the agent says it sent is what the
    // collector holds for this node, and nothing was left queued.
    assert_eq!(report["export"]["queued_batches"], 0, "{report}");
    let sent = report["export"]["samples_sent"]
        .as_u64()
        .expect("samples_sent");
    assert_eq!(collector.total(&format!("node=\"{node}\"")), sent);
    // Nothing of the agent stays loaded.
    let left: Vec<u64> = stackscope_tests::bpf_ids_loaded("prog")
        .difference(&loaded_before)
        .copied()
        .collect();
    assert!(left.is_empty(), "BPF programs left loaded: {left:?}");

    // Each fixture with its own chain, named from its own binary, labelled
    // with where it ran (by container id: names come from the kubelet's pod
    // list on Kubernetes, and no kubelet runs here).
    for (matchers, chain) in [
        (&host_match, "main;a;b;c"),
        (&container_match, "main;outer;middle;inner"),
    ] {
        let stacks = collector.stacks(matchers);
        let total: u64 = stacks.iter().map(|(_, n)| n).sum();
        let chained: u64 = stacks
            .iter()
            .filter(|(stack, _)| stack.contains(chain))
            .map(|(_, n)| n)
            .sum();
        assert!(
            chained * 10 >= total * 9,
            "{chained} of {total} samples of {matchers} read {chain}: {stacks:#?}"
        );
    }
    drop(agent_pod);
    drop(host_process);
    drop(collector_pod);
}

/// The collector the pod runs, queried with the CLI.
struct CollectorAt {
    grpc: String,
}

impl CollectorAt {
    /// The folded stacks matching `matchers` over the last 10 minutes
    /// (none yet is no error).
    fn stacks(&self, matchers: &str) -> Vec<(String, u64)> {
        let out = Command::new(workspace_binary("stackscope"))
            .args(["--collector", &self.grpc])
            .args(["export", "--format", "folded", "--since", "10m"])
            .args(["--match", matchers])
            .output()
            .expect("running stackscope");
        let error = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() && error.contains("no samples match") {
            return Vec::new();
        }
        assert!(out.status.success(), "stackscope export failed: {error}");
        folded(&out.stdout)
    }

    fn total(&self, matchers: &str) -> u64 {
        self.stacks(matchers).iter().map(|(_, n)| n).sum()
    }
}
