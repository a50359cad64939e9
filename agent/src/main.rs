//! `stackscope-agent`: samples every CPU and reports what it sees.
//! The command line lives here; the work is in the `stackscope_agent` library.

use std::{
    io::{IsTerminal as _, Write as _},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use stackscope_agent::{
    aggregate::{
        AggregatorConfig,
        labels::{LabelChoice, host_name},
    },
    export::{
        Compression, ExportConfig, Exporter, TlsConfig,
        debuginfo::{DebuginfoUploader, UploadConfig},
    },
    memory::{self, Consumer, MemoryBudget, parse_size},
    metrics::AgentTelemetry,
    run::{AgentConfig, run},
    stats::report,
};
use stackscope_metadata::{
    kubelet::KubeletConfig,
    runtime_names::{DEFAULT_DOCKER_ROOT, DEFAULT_PODMAN_STORAGE},
    selection::{Budget, SelectionConfig, parse_pod_label},
};
use stackscope_sampler::{OffCpuConfig, Sampler, SamplerConfig};
use stackscope_symbolize::node::SymbolizerConfig;
use stackscope_unwind::walker::{DiskCache, WalkerConfig};
use tracing_subscriber::EnvFilter;

/// Where frames get their names (`--symbolize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Symbolize {
    Collector,
    Both,
}

/// Continuous profiler agent: samples the user and kernel stacks of every CPU
/// with a BPF program on the cpu-clock event.
#[derive(Debug, Parser)]
#[command(name = "stackscope-agent", version)]
struct Args {
    /// Samples per second per CPU (1-10000). Odd primes such as 19 or 997
    /// avoid lock-step with periodic work.
    #[arg(long, default_value_t = 19)]
    frequency: u64,
    /// Most user stack bytes copied per sample (8-32768). Each process and
    /// deep thread gets what its walks need up to this; deeper frames are
    /// read word by word (stack tails), so deep stacks still reach the root.
    #[arg(long, default_value_t = agent_common::DEFAULT_USER_STACK_BYTES)]
    stack_bytes: u32,
    /// Copy --stack-bytes on every tick: no adaptive copies and no stack
    /// tails (for comparison; deep stacks then stop at the copy).
    #[arg(long)]
    fixed_stack_copy: bool,
    /// Most bytes of a deep copy (0 or 4096-2097152): a thread whose deep
    /// frames move too fast for a stack tail (a compiler, hundreds of KB of
    /// stack reshaped every millisecond) has its whole stack copied, up to
    /// this, in one read per tick. About 1 us of CPU per 10 KB copied, and
    /// only for such threads; 0 leaves them truncated instead. The ring of
    /// deep copies, shared by the CPUs, holds three of the largest per 8
    /// CPUs: 2 MiB ones take 8 MiB of ring (16 MB of RSS) on a host of up
    /// to 8 CPUs, 1 MiB ones 4 MiB.
    #[arg(long, default_value_t = agent_common::MAX_DEEP_STACK_BYTES)]
    deep_stack_bytes: u32,
    /// Most frames per user stack.
    #[arg(long, default_value_t = stackscope_unwind::DEFAULT_MAX_DEPTH)]
    max_depth: usize,
    /// Sample only this process; repeat for several. Default: every process.
    /// Combined with the container selections below, both must match.
    #[arg(long = "pid", value_name = "PID")]
    pids: Vec<u32>,
    /// Sample only tasks in this cgroup v2 or below it; repeat for several.
    /// A directory of the cgroup2 hierarchy or a path as /proc/<pid>/cgroup
    /// shows it. The selections (--cgroup, --container, and the pods of
    /// --namespace/--pod-label) add up; the filtering happens in the kernel.
    #[arg(long = "cgroup", value_name = "PATH", help_heading = "Selection")]
    cgroups: Vec<String>,
    /// Sample only this container: its id, an id prefix of 12+ hex digits,
    /// or its name (podman/docker, or the container's name in its pod).
    /// Containers started later are picked up (see --selection-refresh).
    #[arg(long = "container", value_name = "ID|NAME", help_heading = "Selection")]
    containers: Vec<String>,
    /// Sample only the pods of this Kubernetes namespace; repeat for several.
    #[arg(long = "namespace", value_name = "NS", help_heading = "Selection")]
    namespaces: Vec<String>,
    /// Sample only pods with this label (all given labels must match, and
    /// the namespace if one is given).
    #[arg(long = "pod-label", value_name = "KEY=VALUE", value_parser = parse_pod_label, help_heading = "Selection")]
    pod_labels: Vec<(String, String)>,
    /// Sample 1 tick in N of the tasks a selector names (chosen at random in
    /// the kernel); the collector scales their counts back by N. E.g.
    /// `container=batch-job:10`, `namespace=ci:4`, `pod-label=tier=low:8`,
    /// `cgroup=/system.slice/foo.service:2`.
    #[arg(long = "budget", value_name = "SELECTOR:N", help_heading = "Selection")]
    budgets: Vec<Budget>,
    /// How often container and pod selections are resolved again.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration, help_heading = "Selection")]
    selection_refresh: Duration,
    /// Stop after this long (e.g. `30s`, `5m`). Default: until SIGINT/SIGTERM.
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// How often to log the status line.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    status_interval: Duration,
    /// Log level: error, warn, info, debug or trace. Also applies to BPF-side logs.
    #[arg(long, default_value = "info")]
    log_level: tracing::Level,
    /// How many processes to list in the final report.
    #[arg(long, default_value_t = 15)]
    top: usize,
    /// Directory of the on-disk unwind table cache (one file per binary,
    /// by build-id), so a restarted agent does not compile tables again.
    #[arg(long, default_value = "/var/cache/stackscope/tables")]
    table_cache_dir: PathBuf,
    /// Bytes the on-disk table cache may take; the least recently used
    /// tables are removed beyond it.
    #[arg(long, default_value_t = 1 << 30)]
    table_cache_max_bytes: u64,
    /// Keep unwind tables in memory only.
    #[arg(long)]
    no_table_cache: bool,
    /// Where frames get their names: `both` (on the node, from the
    /// binaries' own symbols, separate debug files under the process's or
    /// the host's usr/lib/debug and MiniDebugInfo; frames still unnamed ship
    /// as build-id + offset and the collector fills them in from uploaded or
    /// debuginfod debuginfo), or `collector` (every frame of a file with a
    /// build-id ships unnamed: smaller batches, less agent CPU). Kernel and JIT frames are always named
    /// on the node: nothing else can.
    #[arg(long, value_enum, default_value = "both")]
    symbolize: Symbolize,
    /// Send the collector what binaries carry of their own symbols
    /// (.symtab, DWARF), once per build-id for the whole fleet (the
    /// collector is asked first), one upload at a time, off the sampling
    /// path: frames of those binaries are then named wherever they ship
    /// unnamed.
    #[arg(long, requires = "collector")]
    upload_debuginfo: bool,
    /// Read processes' mappings from /proc only, when first sampled,
    /// instead of learning them from the kernel's mmap events as they are
    /// made (processes that exit within milliseconds then lose their names).
    #[arg(long)]
    no_mapping_events: bool,
    /// Show CPython processes' native frames only: no Python functions in
    /// place of the interpreter's evaluation loop. CPython 3.10 to 3.14 are
    /// read; reading costs the BPF program about 0.1-0.2 us per Python
    /// frame of a sample (`cargo xtask bench sampler`).
    #[arg(long)]
    no_python_frames: bool,
    /// Also profile where threads wait: each selected user thread's stacks
    /// as it blocks (on a lock, I/O, a sleep), weighed by the time until it
    /// runs again, as the `off-cpu` profile type (query it with `--type
    /// off-cpu`). Preempted threads are not waiting: left out. Linux 5.18+.
    #[arg(long)]
    off_cpu: bool,
    /// Off-CPU samples per second per CPU aimed at: a CPU whose threads
    /// block more often keeps one blocking in N (N set every 100 ms from
    /// the rate of blockings), each weighed N times, so totals stay true.
    #[arg(
        long,
        default_value_t = stackscope_sampler::DEFAULT_OFF_CPU_SAMPLES_PER_SEC,
        requires = "off_cpu",
        value_parser = clap::value_parser!(u32).range(1..=1_000_000)
    )]
    off_cpu_rate: u32,
    /// Length of an aggregation interval: identical stacks are summed over
    /// it and shipped as one batch (e.g. `10s`, `1m`).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// The node's name on every sample (default: the host name). On
    /// Kubernetes, pass the node name from the downward API.
    #[arg(long)]
    node_name: Option<String>,
    /// The labels put on samples (`node` is always there): a comma-separated
    /// list of node, comm, exe, pid, container_id, container_name, pod,
    /// namespace, service_name (the pod's app label or workload, else the
    /// container's name, else the executable's file name). A label without
    /// a value (a host process has no pod) is left off.
    #[arg(
        long,
        default_value = "comm,exe,container_id,container_name,pod,namespace,service_name"
    )]
    labels: LabelChoice,
    /// Label every sample with its process id too (one series per process:
    /// many more series in the collector).
    #[arg(long)]
    label_pid: bool,
    /// The kubelet's pod list, for pod, namespace and container names and
    /// for --namespace/--pod-label, e.g. https://127.0.0.1:10250/pods.
    /// Default in Kubernetes: the node's kubelet; elsewhere none.
    #[arg(long, value_name = "URL", help_heading = "Kubernetes")]
    kubelet_url: Option<String>,
    /// Bearer token for the kubelet (default in Kubernetes: the pod's
    /// service account token).
    #[arg(long, value_name = "FILE", help_heading = "Kubernetes")]
    kubelet_token_file: Option<PathBuf>,
    /// PEM CA that signed the kubelet's serving certificate.
    #[arg(long, value_name = "PEM", help_heading = "Kubernetes")]
    kubelet_ca_cert: Option<PathBuf>,
    /// Do not verify the kubelet's certificate (often self-signed).
    #[arg(long, help_heading = "Kubernetes")]
    kubelet_insecure_tls: bool,
    /// How often the pod list is fetched.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration, help_heading = "Kubernetes")]
    kubelet_refresh: Duration,
    /// containers-storage root, where podman keeps its container names.
    #[arg(long, default_value = DEFAULT_PODMAN_STORAGE)]
    podman_storage: PathBuf,
    /// Docker's data root, where it keeps its container names.
    #[arg(long, default_value = DEFAULT_DOCKER_ROOT)]
    docker_root: PathBuf,
    /// The collector's gRPC address (http://HOST:PORT, or https:// for TLS).
    /// Without it, profiles are built but not shipped.
    #[arg(long, value_name = "URL")]
    collector: Option<String>,
    /// PEM CA certificate that signed the collector's certificate (default:
    /// the system's roots).
    #[arg(long, value_name = "PEM")]
    collector_ca_cert: Option<PathBuf>,
    /// Name to verify in the collector's certificate (default: the URL's host).
    #[arg(long)]
    collector_domain: Option<String>,
    /// PEM client certificate and key, for collectors that require mutual TLS.
    #[arg(long, value_name = "PEM", requires = "client_key")]
    client_cert: Option<PathBuf>,
    #[arg(long, value_name = "PEM", requires = "client_cert")]
    client_key: Option<PathBuf>,
    /// File holding the bearer token sent to the collector.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// Compression of batches on the wire.
    #[arg(long, value_enum, default_value_t = Compression::Zstd)]
    compression: Compression,
    /// Bytes of batches held while the collector is unreachable; beyond,
    /// the oldest are dropped (and counted). Default: the export queue's
    /// share of --memory-limit, at most 64 MiB.
    #[arg(long, value_parser = parse_size)]
    max_queue_bytes: Option<u64>,
    /// The memory the agent keeps within (such as 256MiB): split among its
    /// caches and queues, which give way in order: what only costs re-reads
    /// first, then the queues of samples, unused unwind tables last.
    /// Default: 3/4 of the agent's cgroup memory
    /// limit when one is set, else 192 MiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    memory_limit: Option<u64>,
    /// How long shutdown waits to deliver what is still queued.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    shutdown_timeout: Duration,
    /// Turn on the kernel's BPF run-time accounting while running and report
    /// the program's cost per run (adds a little overhead to every run).
    #[arg(long)]
    bpf_stats: bool,
    /// Print the final report as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Serve Prometheus metrics (/metrics) and health probes (/healthz:
    /// the sampling thread sends its totals; /readyz: sampling) over HTTP on this address,
    /// such as 0.0.0.0:9464. Not served unless given.
    #[arg(long, value_name = "ADDR")]
    metrics_address: Option<std::net::SocketAddr>,
}

impl Args {
    /// The most a deep copy reads: none with `--fixed-stack-copy`.
    fn deep_copy_bytes(&self) -> u32 {
        if self.fixed_stack_copy {
            0
        } else {
            self.deep_stack_bytes
        }
    }
}

fn main() -> anyhow::Result<()> {
    memory::return_freed_memory();
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(args.log_level.as_str()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    if args.status_interval.is_zero() {
        anyhow::bail!("--status-interval must be greater than zero");
    }
    if args.interval < Duration::from_secs(1) {
        anyhow::bail!("--interval must be at least 1s");
    }
    if args.node_name.as_deref().is_some_and(str::is_empty) {
        anyhow::bail!("--node-name must not be empty");
    }
    raise_open_file_limit();
    let memory = memory_budget(&args)?;
    // Off-CPU samples waiting for their switch-in are held samples too:
    // they take a quarter of the share.
    let held_samples = share(&memory, Consumer::HeldSamples);
    let off_cpu_held_bytes = if args.off_cpu { held_samples / 4 } else { 0 };

    let config = AgentConfig {
        sampler: SamplerConfig {
            frequency_hz: args.frequency,
            user_stack_bytes: args.stack_bytes,
            deep_stack_bytes: args.deep_copy_bytes(),
            pids: args.pids.clone(),
            bpf_log_level: args.log_level,
            off_cpu: args.off_cpu.then_some(OffCpuConfig {
                samples_per_sec: args.off_cpu_rate,
            }),
            ..SamplerConfig::default()
        },
        duration: args.duration,
        status_interval: args.status_interval,
        walker: WalkerConfig {
            disk_cache: (!args.no_table_cache).then(|| DiskCache {
                dir: args.table_cache_dir.clone(),
                max_bytes: args.table_cache_max_bytes,
            }),
            max_depth: args.max_depth,
            adaptive: !args.fixed_stack_copy,
            table_cache_bytes: share(&memory, Consumer::UnusedUnwindTables),
            max_waiting_bytes: held_samples - off_cpu_held_bytes,
            ..WalkerConfig::default()
        },
        interval: args.interval,
        aggregation: AggregatorConfig {
            node_name: args.node_name.clone().unwrap_or_else(host_name),
            labels: LabelChoice {
                pid: args.labels.pid || args.label_pid,
                ..args.labels
            },
            podman_storage: args.podman_storage.clone(),
            docker_root: args.docker_root.clone(),
            perf_map_bytes: share(&memory, Consumer::PerfMaps),
            jvm_code_bytes: share(&memory, Consumer::JvmCode),
            ..AggregatorConfig::default()
        },
        symbolizer: SymbolizerConfig {
            name_files: args.symbolize != Symbolize::Collector,
            max_open_bytes: memory.share(Consumer::SymbolizerFiles),
            max_go_table_bytes: share(&memory, Consumer::GoTables),
            ..SymbolizerConfig::default()
        },
        selection: SelectionConfig {
            cgroups: args.cgroups.clone(),
            containers: args.containers.clone(),
            namespaces: args.namespaces.clone(),
            pod_labels: args.pod_labels.clone(),
            budgets: args.budgets.clone(),
        },
        selection_refresh: args.selection_refresh,
        kubelet: kubelet_config(&args),
        kubelet_refresh: args.kubelet_refresh,
        mapping_events: !args.no_mapping_events,
        python_frames: !args.no_python_frames,
        python_code_bytes: share(&memory, Consumer::PythonCode),
        off_cpu_held_bytes,
        debuginfo_uploads: None,
        telemetry: args.metrics_address.map(|_| AgentTelemetry::new()),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Accounting stays on for as long as this descriptor is open.
    let _bpf_stats = args
        .bpf_stats
        .then(Sampler::enable_run_time_stats)
        .transpose()
        .context("enabling BPF run-time stats")?;
    let export = export_config(&args, &memory)?;
    let (summary, exported, uploaded) = runtime.block_on(async {
        let telemetry_server = match (&config.telemetry, args.metrics_address) {
            (Some(telemetry), Some(address)) => Some(TelemetryServer::start(telemetry, address)?),
            _ => None,
        };
        let uploader = match (&export, args.upload_debuginfo) {
            (Some(export), true) => Some(
                DebuginfoUploader::start(export, UploadConfig::default())
                    .context("setting up debuginfo uploads to --collector")?,
            ),
            _ => None,
        };
        let config = AgentConfig {
            debuginfo_uploads: uploader.as_ref().map(DebuginfoUploader::queue),
            ..config.clone()
        };
        let exporter = match export {
            Some(export) => Some(Arc::new(
                Exporter::start(export).context("setting up the export to --collector")?,
            )),
            None => {
                tracing::warn!("no --collector given: profiles are built but not shipped");
                None
            }
        };
        if let Some(telemetry) = &config.telemetry {
            telemetry.metrics.set_memory(memory.clone());
        }
        if let (Some(telemetry), Some(exporter)) = (&config.telemetry, &exporter) {
            telemetry.metrics.set_export(exporter.stats_reader());
        }
        let sink = exporter.clone().map(|exporter| {
            Box::new(stackscope_agent::run::ExportSink(exporter))
                as Box<dyn stackscope_agent::run::BatchSink>
        });
        let summary = run(&config, sink).await?;
        // The run dropped the sink, so this is the only handle left.
        // Both get the whole timeout, side by side: shutdown takes at most
        // --shutdown-timeout, not twice it.
        let exporting = async {
            match exporter.map(Arc::into_inner) {
                Some(Some(exporter)) => Some(exporter.shutdown(args.shutdown_timeout).await),
                _ => None,
            }
        };
        let uploading = async {
            match uploader {
                Some(uploader) => Some(uploader.shutdown(args.shutdown_timeout).await),
                None => None,
            }
        };
        let (exported, uploaded) = tokio::join!(exporting, uploading);
        // The endpoints answered while the last batches were delivered.
        if let Some(server) = telemetry_server {
            server.stop().await;
        }
        anyhow::Ok((summary, exported, uploaded))
    })?;
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let mut report = report::json(&summary, exported.as_ref(), uploaded.as_ref(), args.top);
        report["memory"] = memory.json();
        writeln!(stdout, "{report}")
    } else {
        report::write_text(
            &mut stdout,
            &summary,
            exported.as_ref(),
            uploaded.as_ref(),
            args.top,
        )
    }
    .context("writing the report")
}

/// The metrics and health endpoints, served by a task on the runtime that
/// exports (the sampling thread never waits for them, and the liveness
/// answer is the sampling thread's real staleness: its beat comes from
/// that thread's answers). Stopped by [`TelemetryServer::stop`] after the
/// last batches are delivered; dropped, it stops at once.
struct TelemetryServer {
    stop: tokio::sync::watch::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl TelemetryServer {
    fn start(telemetry: &AgentTelemetry, address: std::net::SocketAddr) -> anyhow::Result<Self> {
        // Bound here, so a taken address fails the start with its reason.
        let listener = std::net::TcpListener::bind(address)
            .with_context(|| format!("listening on --metrics-address {address}"))?;
        listener
            .set_nonblocking(true)
            .context("setting up the metrics listener")?;
        let bound = listener
            .local_addr()
            .context("reading the metrics address")?;
        let listener = tokio::net::TcpListener::from_std(listener)
            .context("setting up the metrics listener")?;
        let registry = Arc::new(telemetry.registry());
        let health = Arc::clone(&telemetry.health);
        let (stop, mut stopped) = tokio::sync::watch::channel(());
        let shutdown = async move {
            let _ = stopped.changed().await;
        };
        let task = tokio::spawn(stackscope_telemetry::serve(
            listener, registry, health, shutdown,
        ));
        tracing::info!(metrics = %format!("http://{bound}/metrics"), "serving metrics and health");
        Ok(Self { stop, task })
    }

    /// Stops taking scrapes and lets open ones finish, for at most
    /// [`SERVER_STOP_GRACE`]: a client that keeps its request open does
    /// not hold the agent's exit for long.
    async fn stop(mut self) {
        self.stop.send_replace(());
        match tokio::time::timeout(SERVER_STOP_GRACE, &mut self.task).await {
            Ok(Ok(Err(err))) => tracing::warn!("the metrics server stopped: {err}"),
            Ok(_) => {}
            Err(_) => self.task.abort(),
        }
    }
}

/// How long open scrapes may take once the agent stops.
const SERVER_STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

impl Drop for TelemetryServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The kubelet settings: the flags, else the in-cluster default.
fn kubelet_config(args: &Args) -> Option<KubeletConfig> {
    let mut config = match (&args.kubelet_url, KubeletConfig::in_cluster_default()) {
        (Some(url), in_cluster) => KubeletConfig {
            url: url.clone(),
            ..in_cluster.unwrap_or_else(|| KubeletConfig::new(url))
        },
        (None, in_cluster) => in_cluster?,
    };
    // A given CA wins over skipping verification (the client ignores the
    // latter then).
    config.token_file = args.kubelet_token_file.clone().or(config.token_file);
    config.ca_cert = args.kubelet_ca_cert.clone().or(config.ca_cert);
    config.insecure_skip_tls_verify |= args.kubelet_insecure_tls;
    Some(config)
}

/// The export settings from the command line; `None` without `--collector`.
fn export_config(args: &Args, memory: &MemoryBudget) -> anyhow::Result<Option<ExportConfig>> {
    let Some(endpoint) = &args.collector else {
        return Ok(None);
    };
    let tls = (args.collector_ca_cert.is_some()
        || args.collector_domain.is_some()
        || args.client_cert.is_some())
    .then(|| TlsConfig {
        ca_cert: args.collector_ca_cert.clone(),
        domain: args.collector_domain.clone(),
        client_cert: args.client_cert.clone(),
        client_key: args.client_key.clone(),
    });
    let bearer_token = match &args.token_file {
        Some(path) => {
            let token = std::fs::read_to_string(path)
                .with_context(|| format!("reading --token-file {}", path.display()))?;
            let token = token.trim();
            if token.is_empty() {
                anyhow::bail!("--token-file {} is empty", path.display());
            }
            Some(token.to_string())
        }
        None => None,
    };
    Ok(Some(ExportConfig {
        tls,
        bearer_token,
        compression: args.compression,
        max_queue_bytes: share(memory, Consumer::ExportQueue),
        ..ExportConfig::new(endpoint.clone())
    }))
}

/// The memory budget (`--memory-limit`, else the cgroup's, else the
/// default) split among the caches and queues; `--max-queue-bytes`, when
/// given, is the export queue's share.
fn memory_budget(args: &Args) -> anyhow::Result<MemoryBudget> {
    let (limit, source) = memory::resolve_limit(args.memory_limit);
    let ring = stackscope_sampler::ring_buffer_rss(args.deep_copy_bytes()).unwrap_or(16 << 20);
    let fixed: Vec<_> = args
        .max_queue_bytes
        .map(|bytes| (Consumer::ExportQueue, bytes))
        .into_iter()
        .collect();
    let budget = MemoryBudget::split(limit, source, ring, &fixed)?;
    tracing::info!(
        "memory budget {} ({}): {}",
        memory::Bytes(budget.limit),
        budget.source,
        budget
            .shares()
            .map(|(consumer, share)| format!("{} {}", consumer.name(), memory::Bytes(share)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(budget)
}

/// `consumer`'s share of `memory`, as a size in memory.
fn share(memory: &MemoryBudget, consumer: Consumer) -> usize {
    usize::try_from(memory.share(consumer)).unwrap_or(usize::MAX)
}

/// Raises the soft limit on open files to the hard one (at most 1M): the
/// symbolizer keeps mapped files open, two descriptors each, and the
/// default soft limit of 1024 is too tight for a busy node. Failing only
/// costs names (files that cannot be opened go unnamed), so it is not fatal.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    let wanted = limit.rlim_max.min(1 << 20);
    if wanted > limit.rlim_cur {
        limit.rlim_cur = wanted;
        // SAFETY: setrlimit reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            tracing::debug!(
                "raising the open file limit: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}
