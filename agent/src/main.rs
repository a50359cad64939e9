//! `stackscope-agent`: samples every CPU and reports what it sees.
//! The command line lives here; the work is in the `stackscope_agent` library.

use std::{
    io::{IsTerminal as _, Write},
    path::PathBuf,
    time::Duration,
};

use anyhow::Context as _;
use clap::Parser;
use stackscope_agent::{
    cgroups,
    run::{AgentConfig, RunSummary, run},
    sampler::{Sampler, SamplerConfig},
    unwinding::{DiskCache, WalkerConfig},
};
use tracing_subscriber::EnvFilter;

/// Continuous profiler agent: samples the user and kernel stacks of every CPU
/// with a BPF program on the cpu-clock event.
#[derive(Debug, Parser)]
#[command(name = "stackscope-agent", version)]
struct Args {
    /// Samples per second per CPU (1-10000). Odd primes such as 19 or 997
    /// avoid lock-step with periodic work.
    #[arg(long, default_value_t = 19)]
    frequency: u64,
    /// User stack bytes copied per sample (8-32768).
    #[arg(long, default_value_t = agent_common::DEFAULT_USER_STACK_BYTES)]
    stack_bytes: u32,
    /// Sample only this process; repeat for several. Default: every process.
    #[arg(long = "pid", value_name = "PID")]
    pids: Vec<u32>,
    /// Sample only tasks in this cgroup v2 or below it (as it exists at start);
    /// repeat for several. A directory of the cgroup2 hierarchy or a path as
    /// /proc/<pid>/cgroup shows it. Combined with --pid, both must match.
    #[arg(long = "cgroup", value_name = "PATH")]
    cgroups: Vec<String>,
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
    /// Turn on the kernel's BPF run-time accounting while running and report
    /// the program's cost per run (adds a little overhead to every run).
    #[arg(long)]
    bpf_stats: bool,
    /// Print the final report as JSON on stdout.
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(args.log_level.as_str()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    if args.status_interval.is_zero() {
        anyhow::bail!("--status-interval must be greater than zero");
    }

    let mut cgroup_ids = Vec::new();
    for selection in &args.cgroups {
        cgroup_ids
            .extend(cgroups::resolve(selection).with_context(|| format!("--cgroup {selection}"))?);
    }
    let config = AgentConfig {
        sampler: SamplerConfig {
            frequency_hz: args.frequency,
            user_stack_bytes: args.stack_bytes,
            pids: args.pids.clone(),
            cgroup_ids,
            bpf_log_level: args.log_level,
        },
        duration: args.duration,
        status_interval: args.status_interval,
        walker: WalkerConfig {
            disk_cache: (!args.no_table_cache).then(|| DiskCache {
                dir: args.table_cache_dir.clone(),
                max_bytes: args.table_cache_max_bytes,
            }),
            ..WalkerConfig::default()
        },
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
    let summary = runtime.block_on(run(&config))?;
    let mut stdout = std::io::stdout().lock();
    if args.json {
        writeln!(stdout, "{}", json_report(&summary, args.top))
    } else {
        print_report(&mut stdout, &summary, args.top)
    }
    .context("writing the report")
}

fn json_report(summary: &RunSummary, top: usize) -> serde_json::Value {
    serde_json::json!({
        "elapsed_secs": summary.elapsed.as_secs_f64(),
        "reader": summary.reader,
        "kernel": summary.kernel,
        "bpf": {
            "run_count": summary.program.run_count,
            "ns_per_run": summary.program.per_run().map(|d| d.as_nanos() as u64),
        },
        "unwinding": {
            "walks": summary.unwinding.walks,
            "outermost": summary.unwinding.outermost,
            "tables_compiled": summary.unwinding.tables_compiled,
            "tables_from_disk": summary.unwinding.tables_from_disk,
            "table_cache_hits": summary.unwinding.table_cache_hits,
            "samples_queued": summary.unwinding.samples_queued,
            "queue_full": summary.unwinding.queue_full,
            "table_pending": summary.unwinding.table_pending,
            "tables_failed": summary.unwinding.tables_failed,
            "by_binary": summary.unwinding.by_binary.iter()
                .map(|(name, (walks, outermost))| serde_json::json!({"binary": &**name, "walks": walks, "outermost": outermost}))
                .collect::<Vec<_>>(),
        },
        "top": summary.tally.top(top),
        "other": summary.tally.other(),
    })
}

fn print_report(out: &mut impl Write, summary: &RunSummary, top: usize) -> std::io::Result<()> {
    let total = summary.tally.total();
    writeln!(
        out,
        "{} samples in {:.1}s ({} dropped, {} copy failures, {} decode errors)",
        total,
        summary.elapsed.as_secs_f64(),
        summary.kernel.ring_buffer_full,
        summary.kernel.copy_failed,
        summary.reader.decode_errors,
    )?;
    if let Some(per_run) = summary.program.per_run() {
        writeln!(
            out,
            "BPF program: {} runs, {} ns per run",
            summary.program.run_count,
            per_run.as_nanos()
        )?;
    }
    let unwinding = &summary.unwinding;
    writeln!(
        out,
        "{:.1}% of {} user stacks unwound to the outermost frame ({} tables compiled, {} from disk, \
         {} objects without usable CFI; {} samples waited for a table, {} found the queue full)",
        unwinding.outermost_percent(),
        unwinding.walks,
        unwinding.tables_compiled,
        unwinding.tables_from_disk,
        unwinding.tables_failed,
        unwinding.samples_queued,
        unwinding.queue_full,
    )?;
    let mut by_binary: Vec<_> = unwinding.by_binary.iter().collect();
    by_binary.sort_by(|a, b| b.1.0.cmp(&a.1.0).then(a.0.cmp(b.0)));
    for (binary, (walks, outermost)) in by_binary.into_iter().take(top) {
        writeln!(
            out,
            "{:>9} stacks {:>5.1}% to the outermost frame  {binary}",
            walks,
            100.0 * *outermost as f64 / (*walks).max(1) as f64,
        )?;
    }
    if total == 0 {
        return Ok(());
    }
    writeln!(out, "{:>9}  {:>6}  {:>8}  COMM", "SAMPLES", "SHARE", "PID")?;
    for process in summary.tally.top(top) {
        writeln!(
            out,
            "{:>9}  {:>5.1}%  {:>8}  {}",
            process.samples,
            100.0 * process.samples as f64 / total as f64,
            process.tgid,
            process.comm
        )?;
    }
    if summary.tally.other() > 0 {
        writeln!(
            out,
            "{:>9}  (processes beyond the tracking limit)",
            summary.tally.other()
        )?;
    }
    Ok(())
}
