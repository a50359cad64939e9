//! The description itself: every statistic of the agent, by group. A new
//! counter gets a [`Stat`] here (and its JSON pointer), and every rendering
//! has it. `/metrics` names and JSON pointers that exist are kept as they
//! are: dashboards, the benches and the tests read them.

use super::{Group, RunTotals, Series, Stat, StatUnit, Value};
use crate::run::Wake;

/// Reads the figure at a path of the totals: `field!(kernel.samples)`.
macro_rules! field {
    ($($path:tt)+) => {
        |t: &RunTotals| Value::from(t.$($path)+)
    };
}

/// The series of one of the sampling thread's figures by [`Wake`], labelled
/// by cause: `by_wake!(wakeups)`.
macro_rules! by_wake {
    ($figure:ident) => {
        by_wake!($figure:
            "records" => Records,
            "drain_timer" => DrainTimer,
            "mapping_feed" => MappingFeed,
            "interval_end" => IntervalEnd,
            "answers_wait" => AnswersWait,
            "pods" => Pods,
            "policies" => Policies,
            "gone" => Gone,
            "described" => Described,
            "read" => Read,
            "jit_names" => JitNames,
            "python" => Python,
            "jvm" => Jvm,
            "totals" => Totals,
            "publish" => Publish)
    };
    ($figure:ident: $($label:literal => $wake:ident),+) => {
        &[$(Series::labelled(
            $label,
            concat!("/sampling_thread/", stringify!($figure), "/", $label),
            |t: &RunTotals| Value::from(t.wakeups.$figure[Wake::$wake as usize]),
        )),+]
    };
}

fn always(_: &RunTotals) -> bool {
    true
}

/// Every statistic, in the order of the reports.
pub const GROUPS: &[Group] = &[
    Group {
        title: "sampling",
        json: None,
        present: always,
        stats: SAMPLING,
    },
    Group {
        title: "unwinding",
        json: None,
        present: always,
        stats: UNWINDING,
    },
    Group {
        title: "stack plans",
        json: None,
        present: always,
        stats: STACK_PLANS,
    },
    Group {
        title: "processes",
        json: None,
        present: always,
        stats: PROCESSES,
    },
    Group {
        title: "aggregation",
        json: None,
        present: always,
        stats: AGGREGATION,
    },
    Group {
        title: "batches",
        json: None,
        present: always,
        stats: BATCHES,
    },
    Group {
        title: "naming",
        json: None,
        present: always,
        stats: NAMING,
    },
    Group {
        title: "off-CPU",
        json: None,
        present: |t| t.off_cpu.is_some(),
        stats: OFF_CPU,
    },
    Group {
        title: "export",
        json: Some("/export"),
        present: |t| t.export.is_some(),
        stats: EXPORT,
    },
    Group {
        title: "debuginfo uploads",
        json: Some("/debuginfo_upload"),
        present: |t| t.uploads.is_some(),
        stats: UPLOADS,
    },
    Group {
        title: "agent",
        json: None,
        present: always,
        stats: AGENT,
    },
];

/// Reads an off-CPU figure (the group is shown only when there are some).
macro_rules! off_cpu {
    ($field:ident) => {
        |t: &RunTotals| Value::from(t.off_cpu.map_or(0, |o| o.$field))
    };
}

const OFF_CPU: &[Stat] = &[
    Stat::counter(
        "off_cpu_blocking_switches",
        "Blocking context switches of selected user threads: they left the \
         CPU waiting for an event (not preempted).",
        &[Series::one(
            "/kernel/off_cpu_switches",
            field!(kernel.off_cpu_switches),
        )],
    ),
    Stat::counter(
        "off_cpu_switches",
        "Blocking context switches of selected user threads, by what became \
         of them: sampled, left \
         out by the rate or a budget (their kept neighbours stand for them), \
         or chosen but not written.",
        &[
            Series::labelled(
                "sampled",
                "/kernel/off_cpu_samples",
                field!(kernel.off_cpu_samples),
            ),
            Series::labelled(
                "skipped",
                "/kernel/off_cpu_skipped",
                field!(kernel.off_cpu_skipped),
            ),
            Series::labelled(
                "failed",
                "/kernel/off_cpu_failed",
                field!(kernel.off_cpu_failed),
            ),
        ],
    )
    .by("outcome"),
    Stat::counter(
        "switch_ins",
        "Switch-in records: a sampled blocked thread ran again.",
        &[Series::one("/kernel/switch_ins", field!(kernel.switch_ins))],
    ),
    Stat::counter(
        "off_cpu_samples",
        "Off-CPU samples read, by what became of them: joined with the time \
         they blocked; let go as their process exited or exec'd first; \
         replaced by a newer one of their thread (their switch-in was lost); \
         not held for want of room; walked without their weight.",
        &[
            Series::labelled("joined", "/off_cpu/joined", off_cpu!(joined)),
            Series::labelled(
                "ended_by_exit",
                "/off_cpu/ended_by_exit",
                off_cpu!(ended_by_exit),
            ),
            Series::labelled("replaced", "/off_cpu/replaced", off_cpu!(replaced)),
            Series::labelled(
                "dropped_full",
                "/off_cpu/dropped_full",
                off_cpu!(dropped_full),
            ),
            Series::labelled(
                "weight_missing",
                "/off_cpu/weight_missing",
                off_cpu!(weight_missing),
            ),
        ],
    )
    .by("outcome"),
    Stat::counter(
        "off_cpu_unmatched_switch_ins",
        "Switch-in records that matched no held off-CPU sample.",
        &[Series::one(
            "/off_cpu/unmatched_switch_ins",
            off_cpu!(unmatched_switch_ins),
        )],
    ),
    Stat::counter(
        "off_cpu_blocked_time",
        "Time the joined off-CPU samples' threads were blocked: as sampled, \
         and weighed by each sample's divisor (the blocked time estimated).",
        &[
            Series::labelled("sampled", "/off_cpu/blocked_ns", off_cpu!(blocked_nanos)),
            Series::labelled(
                "estimated",
                "/off_cpu/weighted_blocked_ns",
                off_cpu!(weighted_blocked_nanos),
            ),
        ],
    )
    .by("as")
    .unit(StatUnit::Nanos),
    Stat::counter(
        "off_cpu_bpf_runs",
        "Runs of the off-CPU program, one per context switch (with --bpf-stats).",
        &[Series::one("/off_cpu/bpf_runs", off_cpu!(bpf_runs))],
    ),
    Stat::counter(
        "off_cpu_bpf_run_time",
        "Time the off-CPU program ran (with --bpf-stats).",
        &[Series::one("/off_cpu/bpf_run_ns", off_cpu!(bpf_run_nanos))],
    )
    .unit(StatUnit::Nanos),
    Stat::gauge(
        "off_cpu_bpf_time_per_switch",
        "Mean time of one run of the off-CPU program: its cost per context \
         switch (with --bpf-stats).",
        &[Series::one("/off_cpu/bpf_ns_per_switch", |t| {
            t.off_cpu
                .filter(|o| o.bpf_runs > 0)
                .map(|o| o.bpf_run_nanos / o.bpf_runs)
                .into()
        })],
    )
    .unit(StatUnit::Nanos)
    .reports(),
];

const SAMPLING: &[Stat] = &[
    Stat::counter(
        "ticks",
        "Timer ticks on the CPUs, by what became of them.",
        &[
            Series::labelled("sampled", "/kernel/samples", field!(kernel.samples)),
            Series::labelled("idle", "/kernel/idle", field!(kernel.idle)),
            Series::labelled("filtered", "/kernel/filtered", field!(kernel.filtered)),
            Series::labelled("budgeted", "/kernel/budgeted", field!(kernel.budgeted)),
            Series::labelled(
                "ring_buffer_full",
                "/kernel/ring_buffer_full",
                field!(kernel.ring_buffer_full),
            ),
        ],
    )
    .by("outcome"),
    Stat::counter(
        "samples_lost",
        "Samples lost, by cause.",
        &[
            Series::labelled(
                "ring_buffer_full",
                "/kernel/ring_buffer_full",
                field!(kernel.ring_buffer_full),
            ),
            Series::labelled(
                "decode_error",
                "/reader/decode_errors",
                field!(reader.decode_errors),
            ),
        ],
    )
    .by("cause"),
    Stat::counter(
        "stack_copy_failures",
        "Samples whose user stack copy read no byte.",
        &[Series::one(
            "/kernel/copy_failed",
            field!(kernel.copy_failed),
        )],
    ),
    Stat::counter(
        "address_space_gone_ticks",
        "Kernel-mode ticks of threads whose process had no address space left (exiting): sampled by their kernel stack alone.",
        &[Series::one(
            "/kernel/address_space_gone",
            field!(kernel.address_space_gone),
        )],
    ),
    Stat::counter(
        "samples_read",
        "Sample records read from the ring buffer.",
        &[Series::one("/reader/samples", |t| {
            t.reader
                .records
                .saturating_sub(t.reader.process_events)
                .into()
        })],
    ),
    Stat::counter(
        "process_events_read",
        "Process exec and exit records read from the ring buffer.",
        &[Series::one(
            "/reader/process_events",
            field!(reader.process_events),
        )],
    ),
    Stat::counter(
        "records_read",
        "Records read from the ring buffer: samples and process events.",
        &[Series::one("/reader/records", field!(reader.records))],
    ),
    Stat::counter(
        "ring_buffer_read",
        "Bytes of the records read from the ring buffer.",
        &[Series::one("/reader/bytes", field!(reader.bytes))],
    )
    .unit(StatUnit::Bytes),
    Stat::counter(
        "stack_bytes_copied",
        "User stack bytes the BPF program copied (copies and tails).",
        &[Series::one(
            "/kernel/user_stack_bytes",
            field!(kernel.user_stack_bytes),
        )],
    ),
    Stat::gauge(
        "stack_bytes_per_sample",
        "User stack bytes copied per sample, on average.",
        &[Series::one("/kernel/user_bytes_per_sample", |t| {
            t.kernel.user_bytes_per_sample().into()
        })],
    )
    .unit(StatUnit::Bytes)
    .reports(),
    Stat::counter(
        "tail_spans",
        "Stack tail spans the BPF program read past the copy.",
        &[Series::one("/kernel/tail_spans", field!(kernel.tail_spans))],
    ),
    Stat::counter(
        "deep_copies",
        "Whole-stack copies of threads with a deep plan.",
        &[Series::one(
            "/kernel/deep_copies",
            field!(kernel.deep_copies),
        )],
    ),
    Stat::counter(
        "deep_copies_with_holes",
        "Deep copies read page by page around stack pages never touched (their one read faulted).",
        &[Series::one(
            "/kernel/deep_copies_with_holes",
            field!(kernel.deep_copies_with_holes),
        )],
    ),
    Stat::counter(
        "deep_copy_fallbacks",
        "Ticks of deep-plan threads that fell back to the usual copy.",
        &[Series::one(
            "/kernel/deep_copy_fallbacks",
            field!(kernel.deep_copy_fallbacks),
        )],
    ),
    Stat::counter(
        "direct_copy_fallbacks",
        "Ticks of learned threads whose copy straight into the sample area \
         or the ring buffer failed (no room, or a faulting read) and took the \
         usual copy.",
        &[Series::one(
            "/kernel/direct_copy_fallbacks",
            field!(kernel.direct_copy_fallbacks),
        )],
    ),
    Stat::counter(
        "bad_area_records",
        "Records the reader found bad in a CPU's sample area; each time, the \
         area's unread records were given up.",
        &[Series::one(
            "/kernel/bad_area_records",
            field!(kernel.bad_area_records),
        )],
    ),
    Stat::counter(
        "early_wakeups",
        "Records that woke the reader at once: ticks of threads not learned yet \
         of programs whose threads needed deep copies.",
        &[Series::one(
            "/kernel/early_wakeups",
            field!(kernel.early_wakeups),
        )],
    ),
    Stat::counter(
        "python_stacks",
        "Python stack records the sampler wrote: ticks of CPython threads \
         with a thread state.",
        &[Series::one(
            "/kernel/python_stacks",
            field!(kernel.python_stacks),
        )],
    ),
    Stat::counter(
        "python_frames",
        "Python frames in those records.",
        &[Series::one(
            "/kernel/python_frames",
            field!(kernel.python_frames),
        )],
    ),
    Stat::counter(
        "bpf_runs",
        "Runs of the BPF program, counted while the kernel's BPF statistics \
         are on (--bpf-stats).",
        &[Series::one("/bpf/run_count", field!(program.run_count))],
    ),
    Stat::counter(
        "bpf_run_time",
        "Time the BPF program ran, counted while the kernel's BPF statistics \
         are on (--bpf-stats).",
        &[Series::one("/bpf/run_ns", |t| {
            u64::try_from(t.program.run_time.as_nanos())
                .unwrap_or(u64::MAX)
                .into()
        })],
    )
    .unit(StatUnit::Nanos),
    Stat::gauge(
        "bpf_time_per_run",
        "Mean time of one run of the BPF program (with --bpf-stats).",
        &[Series::one("/bpf/ns_per_run", |t| {
            t.program
                .per_run()
                .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
                .into()
        })],
    )
    .unit(StatUnit::Nanos)
    .reports(),
    Stat::counter(
        "hash_probes",
        "Hash-table lookups of the sampling thread, by key: per process, per thread, \
         derived from a process (binary name, label set), or an interval's \
         dictionaries. Divided by samples_read: the lookups a sample costs.",
        &[
            Series::labelled("process", "/probes/by_kind/process", field!(probes.process)),
            Series::labelled("thread", "/probes/by_kind/thread", field!(probes.thread)),
            Series::labelled("derived", "/probes/by_kind/derived", field!(probes.derived)),
            Series::labelled("content", "/probes/by_kind/content", field!(probes.content)),
        ],
    )
    .by("kind"),
    Stat::gauge(
        "hash_probes_per_sample",
        "Hash-table lookups of the sampling thread per sample read.",
        &[Series::one("/probes/per_sample", |t| {
            let samples = t.reader.records.saturating_sub(t.reader.process_events);
            (t.probes.total() as f64 / samples.max(1) as f64).into()
        })],
    )
    .reports(),
];

const UNWINDING: &[Stat] = &[
    Stat::counter(
        "walks",
        "User stack walks, by how they ended: at the root from the copied bytes, \
         at the root through a stitched tail, out of stack bytes, or otherwise \
         (unknown code, a bad rule, the depth limit).",
        &[
            Series::labelled("root", "/unwinding/root", |t| {
                let reached = t.walks.outermost.min(t.walks.walks);
                (reached - t.walks.stitched.min(reached)).into()
            }),
            Series::labelled("stitched", "/unwinding/stitched", |t| {
                t.walks
                    .stitched
                    .min(t.walks.outermost.min(t.walks.walks))
                    .into()
            }),
            Series::labelled("truncated", "/unwinding/truncated", field!(walks.truncated)),
            Series::labelled("other", "/unwinding/other", |t| {
                let w = &t.walks;
                w.walks
                    .saturating_sub(w.outermost.min(w.walks))
                    .saturating_sub(w.truncated)
                    .into()
            }),
        ],
    )
    .by("end"),
    Stat::counter(
        "walks_in_all",
        "User stack walks (all ends).",
        &[Series::one("/unwinding/walks", field!(walks.walks))],
    )
    .reports(),
    Stat::counter(
        "walks_to_root",
        "Walks that reached the outermost frame, through a stitched tail or not.",
        &[Series::one("/unwinding/outermost", field!(walks.outermost))],
    )
    .reports(),
    Stat::gauge(
        "walks_to_root_share",
        "Share of the walks that reached the outermost frame.",
        &[Series::one("/unwinding/outermost_percent", |t| {
            t.walks.outermost_percent().into()
        })],
    )
    .unit(StatUnit::Percent)
    .reports(),
    Stat::counter(
        "walks_stopped_early",
        "Walks that stopped before the outermost frame with stack bytes left, \
         by reason: an address in no known mapping, code without unwind info, \
         CFI the unwinder cannot evaluate, code that switches stacks, a corrupt \
         frame, --max-depth, a table still being compiled.",
        &[
            Series::labelled(
                "unmapped",
                "/unwinding/early_ends/unmapped",
                field!(walks.early_ends.unmapped),
            ),
            Series::labelled(
                "no_unwind_info",
                "/unwinding/early_ends/no_unwind_info",
                field!(walks.early_ends.no_unwind_info),
            ),
            Series::labelled(
                "unsupported",
                "/unwinding/early_ends/unsupported",
                field!(walks.early_ends.unsupported),
            ),
            Series::labelled(
                "stack_switch",
                "/unwinding/early_ends/stack_switch",
                field!(walks.early_ends.stack_switch),
            ),
            Series::labelled(
                "corrupt",
                "/unwinding/early_ends/corrupt",
                field!(walks.early_ends.corrupt),
            ),
            Series::labelled(
                "depth_limit",
                "/unwinding/early_ends/depth_limit",
                field!(walks.early_ends.depth_limit),
            ),
            Series::labelled(
                "table_pending",
                "/unwinding/early_ends/table_pending",
                field!(walks.early_ends.table_pending),
            ),
        ],
    )
    .by("reason"),
    Stat::counter(
        "kernel_ticks_unplaced",
        "Kernel ticks whose user instruction pointer was in no known mapping \
         (inside exec or exit): counted as kernel samples, not walked.",
        &[Series::one(
            "/unwinding/kernel_ticks_unplaced",
            field!(walks.kernel_ticks_unplaced),
        )],
    ),
    Stat::counter(
        "jit_walks",
        "Walks with at least one frame in JIT code.",
        &[Series::one("/unwinding/jit_walks", field!(walks.jit_walks))],
    ),
    Stat::counter(
        "jit_walks_to_root",
        "Walks through JIT code that reached the outermost frame.",
        &[Series::one(
            "/unwinding/jit_outermost",
            field!(walks.jit_outermost),
        )],
    ),
    Stat::counter(
        "unwind_tables",
        "Unwind tables made ready, by where they came from; failed: walked with frame pointers.",
        &[
            Series::labelled(
                "compiled",
                "/unwinding/tables_compiled",
                field!(walks.tables_compiled),
            ),
            Series::labelled(
                "disk",
                "/unwinding/tables_from_disk",
                field!(walks.tables_from_disk),
            ),
            Series::labelled(
                "failed",
                "/unwinding/tables_failed",
                field!(walks.tables_failed),
            ),
        ],
    )
    .by("source"),
    Stat::counter(
        "unwind_tables_evicted",
        "Unwind tables no live process used, dropped for their share of the memory budget.",
        &[Series::one(
            "/unwinding/tables_evicted",
            field!(walks.tables_evicted),
        )],
    ),
    Stat::counter(
        "unwind_table_cache_hits",
        "Module resolutions answered by the in-memory table cache.",
        &[Series::one(
            "/unwinding/table_cache_hits",
            field!(walks.table_cache_hits),
        )],
    ),
    Stat::counter(
        "samples_queued_for_tables",
        "Samples held for a table being compiled.",
        &[Series::one(
            "/unwinding/samples_queued",
            field!(walks.samples_queued),
        )],
    ),
    Stat::counter(
        "table_queue_full",
        "Samples walked without waiting because the queue was full.",
        &[Series::one(
            "/unwinding/queue_full",
            field!(walks.queue_full),
        )],
    ),
    Stat::counter(
        "table_pending_walks",
        "Walks that ended short because a table was still being compiled.",
        &[Series::one(
            "/unwinding/table_pending",
            field!(walks.table_pending),
        )],
    ),
    Stat::counter(
        "unwind_rules_read_directly",
        "Rules read from a binary's CFI directly while its table compiled.",
        &[Series::one(
            "/unwinding/rules_read_directly",
            field!(walks.rules_read_directly),
        )],
    ),
    Stat::counter(
        "state_resets",
        "Times every process's state was dropped after lost exec or exit records.",
        &[Series::one(
            "/unwinding/state_resets",
            field!(walks.state_resets),
        )],
    ),
    Stat::counter(
        "processes_replaced",
        "Processes whose state was dropped because a sample showed their pid in \
         use by a process that started later (their exit record was lost).",
        &[Series::one(
            "/unwinding/processes_replaced",
            field!(walks.processes_replaced),
        )],
    ),
];

const STACK_PLANS: &[Stat] = &[
    Stat::counter(
        "stack_plans_learned",
        "Threads whose deep frames were learned into a copy plan (deep copies included).",
        &[Series::one(
            "/unwinding/plans/plans_learned",
            field!(walks.plans.plans_learned),
        )],
    ),
    Stat::counter(
        "deep_stack_plans_learned",
        "Of the plans learned, deep copies (the whole stack at every tick).",
        &[Series::one(
            "/unwinding/plans/deep_plans_learned",
            field!(walks.plans.deep_plans_learned),
        )],
    ),
    Stat::counter(
        "stack_plan_learn_failures",
        "Learning reads that gave no plan (the thread was gone, the walk did \
         not reach the root, or the stack was too deep).",
        &[Series::one(
            "/unwinding/plans/learn_failed",
            field!(walks.plans.learn_failed),
        )],
    ),
    Stat::counter(
        "stack_plan_learn_too_late",
        "Of the learning reads that gave no plan, those that found the \
         thread's process exited.",
        &[Series::one(
            "/unwinding/plans/learn_too_late",
            field!(walks.plans.learn_too_late),
        )],
    ),
    Stat::counter(
        "stack_plan_learn_throttled",
        "Learning reads skipped by the rate limits.",
        &[Series::one(
            "/unwinding/plans/learn_throttled",
            field!(walks.plans.learn_throttled),
        )],
    ),
    Stat::counter(
        "stack_copy_size_updates",
        "Copy size changes written for processes.",
        &[Series::one(
            "/unwinding/plans/copy_updates",
            field!(walks.plans.copy_updates),
        )],
    ),
    Stat::counter(
        "stack_tops",
        "Stack tops of threads written for the BPF program (their copies stop \
         where their walks reach the root), dropped because a copy that \
         stopped there ran out, and evicted: given up by a full set of the \
         program's table for another thread's (written again at the thread's \
         next walk to the root; many mean more live threads than it holds).",
        &[
            Series::labelled(
                "written",
                "/unwinding/plans/tops_written",
                field!(walks.plans.tops_written),
            ),
            Series::labelled(
                "dropped",
                "/unwinding/plans/tops_dropped",
                field!(walks.plans.tops_dropped),
            ),
            Series::labelled(
                "evicted",
                "/unwinding/plans/tops_evicted",
                field!(walks.plans.tops_evicted),
            ),
        ],
    )
    .by("action"),
    Stat::counter(
        "stack_walks_truncated",
        "Walks that ran out of stack, by what the tick copied: a process's \
         adaptive copy, the whole ceiling (a thread deeper than any copy, not \
         learned yet), up to a stack top the thread had left, a plan's stale \
         tail, a deep copy, or a copy stopped by a page not in memory.",
        &[
            Series::labelled(
                "short_copy",
                "/unwinding/plans/truncated_by/short_copy",
                field!(walks.plans.truncated_by.short_copy),
            ),
            Series::labelled(
                "ceiling",
                "/unwinding/plans/truncated_by/ceiling",
                field!(walks.plans.truncated_by.ceiling),
            ),
            Series::labelled(
                "stack_top",
                "/unwinding/plans/truncated_by/stack_top",
                field!(walks.plans.truncated_by.stack_top),
            ),
            Series::labelled(
                "stale_tail",
                "/unwinding/plans/truncated_by/stale_tail",
                field!(walks.plans.truncated_by.stale_tail),
            ),
            Series::labelled(
                "deep_copy",
                "/unwinding/plans/truncated_by/deep_copy",
                field!(walks.plans.truncated_by.deep_copy),
            ),
            Series::labelled(
                "faulted",
                "/unwinding/plans/truncated_by/faulted",
                field!(walks.plans.truncated_by.faulted),
            ),
        ],
    )
    .by("copy"),
    Stat::gauge(
        "deep_programs_remembered",
        "Programs known to need deep copies from the start: remembered \
         beside the table cache by an earlier agent.",
        &[Series::one(
            "/unwinding/plans/deep_programs_remembered",
            field!(walks.plans.deep_programs_remembered),
        )],
    ),
    Stat::counter(
        "deep_programs_refused",
        "Files of remembered deep programs refused (damaged, or of another \
         format) and removed.",
        &[Series::one(
            "/unwinding/plans/deep_programs_refused",
            field!(walks.plans.deep_programs_refused),
        )],
    ),
    Stat::gauge(
        "stack_plans",
        "Copy plans of threads in use.",
        &[Series::one(
            "/unwinding/plans/thread_plans",
            field!(walks.plans.thread_plans),
        )],
    ),
    Stat::gauge(
        "deep_stack_plans",
        "Of the plans in use, deep copies.",
        &[Series::one(
            "/unwinding/plans/thread_deep_plans",
            field!(walks.plans.thread_deep_plans),
        )],
    ),
];

const PROCESSES: &[Stat] = &[
    Stat::gauge(
        "mapping_feed_open",
        "1 while mappings are learned from the kernel's events as they are \
         made; 0: from /proc only (processes that exit within milliseconds \
         lose their names).",
        &[Series::one("/mapping_feed/open", field!(mapping_feed.open))],
    ),
    Stat::counter(
        "mapping_events",
        "Process events the mapping feed read, by kind.",
        &[
            Series::labelled("fork", "/mapping_feed/forks", field!(mapping_feed.forks)),
            Series::labelled("exec", "/mapping_feed/execs", field!(mapping_feed.execs)),
            Series::labelled("mmap", "/mapping_feed/mmaps", field!(mapping_feed.mmaps)),
        ],
    )
    .by("event"),
    Stat::counter(
        "mapping_events_lost",
        "Mapping event records the kernel lost (its ring was full).",
        &[Series::one("/mapping_feed/lost", field!(mapping_feed.lost))],
    ),
    Stat::counter(
        "mapping_events_malformed",
        "Mapping event records that did not parse.",
        &[Series::one(
            "/mapping_feed/malformed",
            field!(mapping_feed.malformed),
        )],
    ),
    Stat::counter(
        "mapping_feed_resyncs",
        "Times the mapping feed skipped a ring's contents as corrupt.",
        &[Series::one(
            "/mapping_feed/resyncs",
            field!(mapping_feed.resyncs),
        )],
    ),
    Stat::counter(
        "mapping_events_applied_early",
        "Mapping events applied before their time because too many were pending.",
        &[Series::one(
            "/mapping_feed/applied_early",
            field!(mapping_feed.applied_early),
        )],
    ),
    Stat::counter(
        "process_table_lookups",
        "Lookups of processes' mappings in the process table.",
        &[Series::one(
            "/process_table/lookups",
            field!(process_table.lookups),
        )],
    ),
    Stat::counter(
        "proc_maps_reads",
        "Reads of a /proc/<pid>/maps (first sight and re-reads, processes \
         found gone included).",
        &[Series::one(
            "/process_table/maps_reads",
            field!(process_table.maps_reads),
        )],
    ),
    Stat::counter(
        "proc_maps_rereads_rate_limited",
        "Misses that did not read a process's maps again because the last \
         read was too recent.",
        &[Series::one(
            "/process_table/rereads_rate_limited",
            field!(process_table.rereads_rate_limited),
        )],
    ),
    Stat::counter(
        "objects_identified",
        "Mapped files opened and identified (object cache misses).",
        &[Series::one(
            "/process_table/objects_identified",
            field!(process_table.objects_identified),
        )],
    ),
    Stat::counter(
        "object_cache_hits",
        "Mappings whose file was found in the object cache.",
        &[Series::one(
            "/process_table/object_cache_hits",
            field!(process_table.object_cache_hits),
        )],
    ),
    Stat::counter(
        "build_ids_unverified",
        "Files claiming a build-id that were not digested (too large, or over \
         the digest budget): not shared with their copies.",
        &[Series::one(
            "/process_table/build_ids_unverified",
            field!(process_table.build_ids_unverified),
        )],
    ),
    Stat::counter(
        "process_table_evictions",
        "Processes dropped to keep the process table within its bound.",
        &[Series::one(
            "/process_table/evictions",
            field!(process_table.evictions),
        )],
    ),
    Stat::counter(
        "mappings_learned",
        "Executable mappings learned from mmap events.",
        &[Series::one(
            "/process_table/mappings_learned",
            field!(process_table.mappings_learned),
        )],
    ),
    Stat::counter(
        "mappings_unidentified",
        "Of the mappings learned, files that could not be reached or \
         identified: their frames stay unnamed.",
        &[Series::one(
            "/process_table/learned_unidentified",
            field!(process_table.learned_unidentified),
        )],
    ),
    Stat::counter(
        "lookups_after_exit",
        "Lookups answered from learned mappings after the process's maps could \
         no longer be read (it had exited).",
        &[Series::one(
            "/process_table/answered_after_exit",
            field!(process_table.answered_after_exit),
        )],
    ),
    Stat::counter(
        "proc_reads_deferred",
        "Process table reads (maps, mapped files' identities) handed to the \
         metadata worker; the samples that needed one waited for it.",
        &[Series::one(
            "/process_table/reads_deferred",
            field!(process_table.reads_deferred),
        )],
    ),
    Stat::counter(
        "exited_processes",
        "Sampled processes that exited while the agent ran.",
        &[Series::one(
            "/exited_processes",
            field!(processes.exited_processes),
        )],
    ),
    Stat::counter(
        "exited_process_samples",
        "Samples of the sampled processes that exited while the agent ran.",
        &[Series::one(
            "/exited_samples",
            field!(processes.exited_samples),
        )],
    ),
    Stat::counter(
        "untracked_process_samples",
        "Samples of processes that came after the per-process tally was full.",
        &[Series::one("/other", field!(processes.untracked_samples))],
    ),
];

const AGGREGATION: &[Stat] = &[
    Stat::counter(
        "aggregated_samples",
        "Samples counted into intervals (truncated ones included).",
        &[Series::one(
            "/aggregation/samples",
            field!(aggregation.samples),
        )],
    ),
    Stat::counter(
        "kernel_thread_samples",
        "Of the samples counted, samples of kernel threads (no user part).",
        &[Series::one(
            "/aggregation/kernel_only",
            field!(aggregation.kernel_only),
        )],
    ),
    Stat::counter(
        "empty_samples",
        "Samples without a single frame (a kernel thread's stack could not be \
         read): counted nowhere.",
        &[Series::one("/aggregation/empty", field!(aggregation.empty))],
    ),
    Stat::counter(
        "interval_full_samples",
        "Samples an interval had no room for, by what became of them: counted \
         under the [truncated] stack, or dropped.",
        &[
            Series::labelled(
                "truncated",
                "/aggregation/truncated",
                field!(aggregation.truncated),
            ),
            Series::labelled(
                "dropped",
                "/aggregation/dropped",
                field!(aggregation.dropped),
            ),
        ],
    )
    .by("outcome"),
    Stat::counter(
        "intervals_finished",
        "Aggregation intervals finished.",
        &[Series::one(
            "/aggregation/intervals",
            field!(aggregation.intervals),
        )],
    ),
    Stat::gauge(
        "interval_stacks",
        "Distinct (labels, stack) pairs in the interval being aggregated.",
        &[Series::one(
            "/aggregation/distinct",
            field!(aggregation.distinct),
        )],
    ),
    Stat::gauge(
        "interval_stacks_max",
        "The most distinct (labels, stack) pairs an interval had.",
        &[Series::one(
            "/aggregation/max_distinct",
            field!(aggregation.max_distinct),
        )],
    ),
    Stat::counter(
        "aggregation_files_opened",
        "Mapped files opened while aggregating (failed opens included).",
        &[Series::one(
            "/aggregation/files_opened",
            field!(aggregation.files_opened),
        )],
    ),
    Stat::counter(
        "aggregation_file_failures",
        "Mapped files that could not be opened while aggregating.",
        &[Series::one(
            "/aggregation/files_failed",
            field!(aggregation.files_failed),
        )],
    ),
    Stat::counter(
        "labels_undescribed",
        "Label sets shipped before their process was described (after their \
         interval ended): without their container, and without their exe \
         unless the mapping feed saw the process exec.",
        &[Series::one(
            "/aggregation/labels_undescribed",
            field!(aggregation.labels_undescribed),
        )],
    ),
    Stat::counter(
        "jvm_processes",
        "Processes mapping libjvm.so whose HotSpot JVM is read (their Java \
         frames stepped through and named), and those whose could not be.",
        &[
            Series::labelled("read", "/jvm/processes", field!(jvm.processes)),
            Series::labelled("unreadable", "/jvm/unreadable", field!(jvm.unreadable)),
        ],
    )
    .by("outcome"),
    Stat::counter(
        "jvm_code_blobs",
        "Code blobs read from the JVMs' code caches, reads that failed (a \
         frame there ends its walk), and cached blobs found replaced when \
         checked again (read anew).",
        &[
            Series::labelled("read", "/jvm/blobs_read", field!(jvm.blobs_read)),
            Series::labelled("failed", "/jvm/blob_errors", field!(jvm.blob_errors)),
            Series::labelled(
                "replaced",
                "/jvm/blobs_replaced",
                field!(jvm.blobs_replaced),
            ),
        ],
    )
    .by("outcome"),
    Stat::counter(
        "jvm_method_names",
        "Java methods named from the JVMs' metadata, and those that could not \
         be (their frames keep the process's [jit] name).",
        &[
            Series::labelled("read", "/jvm/names_read", field!(jvm.names_read)),
            Series::labelled("failed", "/jvm/name_errors", field!(jvm.name_errors)),
        ],
    )
    .by("outcome"),
    Stat::counter(
        "jvm_inlining",
        "Compiled Java methods whose inlining was read, and those whose could \
         not be (their frames show the compiled method alone).",
        &[
            Series::labelled("read", "/jvm/scopes_read", field!(jvm.scopes_read)),
            Series::labelled("failed", "/jvm/scope_errors", field!(jvm.scope_errors)),
        ],
    )
    .by("outcome"),
    Stat::counter(
        "jvm_caches_cleared",
        "JVMs' caches of code blobs, method names and inlining emptied to keep \
         them all within their share of the memory limit (read again as \
         samples need them).",
        &[Series::one(
            "/jvm/caches_cleared",
            field!(jvm.caches_cleared),
        )],
    ),
    Stat::counter(
        "python_processes",
        "Processes found running a CPython the sampler reads the frames of.",
        &[Series::one("/python/processes", field!(python.processes))],
    ),
    Stat::counter(
        "python_stacks_read",
        "Python stack records read.",
        &[Series::one("/python/stacks", field!(python.stacks))],
    ),
    Stat::counter(
        "python_stacks_paired",
        "Python stack records paired with their sample (the others: the \
         sample's record was lost, or the process's record had gone).",
        &[Series::one("/python/paired", field!(python.paired))],
    ),
    Stat::counter(
        "python_code_caches_cleared",
        "Processes' Python code objects dropped to keep them all within their \
         share of the memory limit (read again as samples name them).",
        &[Series::one(
            "/python/code_caches_cleared",
            field!(python.code_caches_cleared),
        )],
    ),
    Stat::counter(
        "python_frames_merged",
        "Python frames merged into walks: named, or unnamed because the \
         object at the address was another (stale: the one sampled was \
         freed, its address reused) or none (unreadable).",
        &[
            Series::labelled(
                "named",
                "/aggregation/python_named",
                field!(aggregation.python_named),
            ),
            Series::labelled(
                "stale",
                "/aggregation/python_stale",
                field!(aggregation.python_stale),
            ),
            Series::labelled(
                "unreadable",
                "/aggregation/python_unreadable",
                field!(aggregation.python_unreadable),
            ),
        ],
    )
    .by("result"),
    Stat::counter(
        "python_activations_unplaced",
        "Activations of Python frames left out: the native walk had no \
         evaluation frame left for them.",
        &[Series::one(
            "/aggregation/python_unplaced",
            field!(aggregation.python_unplaced),
        )],
    ),
    Stat::counter(
        "python_activations_cut",
        "Activations of Python frames read only in part (the sampler's \
         frame limit, a failed read): their frames not read stand as one \
         marked frame.",
        &[Series::one(
            "/aggregation/python_cut",
            field!(aggregation.python_cut),
        )],
    ),
    Stat::counter(
        "jit_frames",
        "JIT frames, by whether a perf map entry named them.",
        &[
            Series::labelled("named", "/jit_names/named", field!(jit_names.named)),
            Series::labelled("unnamed", "/jit_names/unnamed", field!(jit_names.unnamed)),
        ],
    )
    .by("result"),
    Stat::counter(
        "perf_map_lines",
        "Perf map lines read into entries.",
        &[Series::one("/jit_names/lines", field!(jit_names.lines))],
    ),
    Stat::counter(
        "perf_map_lines_malformed",
        "Perf map lines skipped as malformed.",
        &[Series::one(
            "/jit_names/malformed",
            field!(jit_names.malformed),
        )],
    ),
    Stat::counter(
        "perf_map_lines_over_budget",
        "Perf map lines skipped because the entries were at their byte bound \
         (the total, or the process's share of it).",
        &[Series::one(
            "/jit_names/over_budget",
            field!(jit_names.over_budget),
        )],
    ),
    Stat::counter(
        "perf_maps_evicted",
        "Perf maps dropped to stay within their bounds.",
        &[Series::one("/jit_names/evicted", field!(jit_names.evicted))],
    ),
];

const BATCHES: &[Stat] = &[
    Stat::counter(
        "batches_built",
        "Aggregated batches built.",
        &[Series::one("/batches/built", field!(batches.batches_built))],
    ),
    Stat::counter(
        "intervals_dropped",
        "Aggregation intervals lost because the batch builder had stopped.",
        &[Series::one(
            "/batches/intervals_dropped",
            field!(batches.intervals_dropped),
        )],
    ),
    Stat::counter(
        "intervals_extended",
        "Interval ends passed over because the batch builder was still busy: the interval ran on.",
        &[Series::one(
            "/batches/intervals_extended",
            field!(batches.intervals_extended),
        )],
    ),
    Stat::counter(
        "thread_messages_dropped",
        "Messages between the agent's threads dropped because their queue was full.",
        &[
            Series::labelled(
                "sampling",
                "/handoffs/commands_dropped",
                field!(handoffs.commands_dropped),
            ),
            Series::labelled(
                "runtime",
                "/handoffs/reports_dropped",
                field!(handoffs.reports_dropped),
            ),
            Series::labelled(
                "metadata",
                "/handoffs/jobs_dropped",
                field!(handoffs.jobs_dropped),
            ),
        ],
    )
    .by("queue"),
    Stat::counter(
        "intervals_empty",
        "Intervals without a sample: no batch is built for them.",
        &[Series::one(
            "/batches/intervals_empty",
            field!(batches.intervals_empty),
        )],
    ),
    Stat::counter(
        "batch_samples",
        "Samples in the batches built (the sum of their counts).",
        &[Series::one(
            "/batches/samples",
            field!(batches.samples_in_batches),
        )],
    ),
    Stat::counter(
        "batch_build",
        "Time spent building batches, naming included.",
        &[Series::one(
            "/batches/build_micros_total",
            field!(batches.build_micros_total),
        )],
    )
    .unit(StatUnit::Micros),
    Stat::gauge(
        "last_batch_build",
        "Time the last batch took to build, naming included.",
        &[Series::one(
            "/batches/build_micros_last",
            field!(batches.build_micros_last),
        )],
    )
    .unit(StatUnit::Micros),
    Stat::gauge(
        "batch_build_max",
        "The longest a batch took to build, naming included.",
        &[Series::one(
            "/batches/build_micros_max",
            field!(batches.build_micros_max),
        )],
    )
    .unit(StatUnit::Micros),
    Stat::gauge(
        "last_batch",
        "Encoded size of the last batch built.",
        &[Series::one(
            "/batches/last_batch_bytes",
            field!(batches.last_batch_bytes),
        )],
    )
    .unit(StatUnit::Bytes),
    Stat::gauge(
        "last_batch_entries",
        "Entries of the last batch built, by table: locations, stacks, samples.",
        &[
            Series::labelled(
                "locations",
                "/batches/last_batch_locations",
                field!(batches.last_batch_locations),
            ),
            Series::labelled(
                "stacks",
                "/batches/last_batch_stacks",
                field!(batches.last_batch_stacks),
            ),
            Series::labelled(
                "samples",
                "/batches/last_batch_samples",
                field!(batches.last_batch_samples),
            ),
        ],
    )
    .by("table"),
    Stat::counter(
        "heap_trims",
        "Times the heap's free pages were handed back to the kernel (more than 16 MiB free).",
        &[Series::one(
            "/batches/heap_trims",
            field!(batches.heap_trims),
        )],
    ),
];

const NAMING: &[Stat] = &[
    Stat::counter(
        "symbol_cache_lookups",
        "Lookups of user and vDSO frames in the name cache, by result.",
        &[
            Series::labelled(
                "hit",
                "/symbolization/counts/cache_hits",
                field!(batches.symbolize.cache_hits),
            ),
            Series::labelled(
                "miss",
                "/symbolization/counts/cache_misses",
                field!(batches.symbolize.cache_misses),
            ),
        ],
    )
    .by("result"),
    Stat::gauge(
        "symbol_cache_hit_share",
        "Share of the name cache lookups answered by the cache.",
        &[Series::one("/symbolization/cache_hit_percent", |t| {
            t.batches.symbolize.cache_hit_percent().into()
        })],
    )
    .unit(StatUnit::Percent)
    .reports(),
    Stat::counter(
        "frames_named",
        "Name cache misses that found a name.",
        &[Series::one(
            "/symbolization/counts/named",
            field!(batches.symbolize.named),
        )],
    ),
    Stat::counter(
        "frames_without_symbol",
        "Name cache misses that no symbol covers.",
        &[Series::one(
            "/symbolization/counts/no_symbol",
            field!(batches.symbolize.no_symbol),
        )],
    ),
    Stat::counter(
        "frames_unreadable",
        "Frames left unnamed because their file could not be opened or read.",
        &[Series::one(
            "/symbolization/counts/errors",
            field!(batches.symbolize.errors),
        )],
    ),
    Stat::counter(
        "debug_files_used",
        "Stripped files named from a separate debug file found on the node.",
        &[Series::one(
            "/symbolization/counts/debug_files",
            field!(batches.symbolize.debug_files),
        )],
    ),
    Stat::counter(
        "go_frames_named",
        "Frames of Go binaries named from their function table (.gopclntab), \
         which blazesym left unnamed.",
        &[Series::one(
            "/symbolization/counts/go_named",
            field!(batches.symbolize.go_named),
        )],
    ),
    Stat::counter(
        "frames_left_to_collector",
        "Frames of files with a build-id left for the collector to name \
         (--symbolize collector).",
        &[Series::one(
            "/symbolization/counts/left_to_collector",
            field!(batches.symbolize.left_to_collector),
        )],
    ),
    Stat::counter(
        "frames_deferred",
        "Frames left unnamed because the batch's time for naming ran out \
         (looked up again for the next batch).",
        &[Series::one(
            "/symbolization/counts/deferred",
            field!(batches.symbolize.deferred),
        )],
    ),
    Stat::counter(
        "kernel_frames",
        "Kernel frames, by whether a kernel symbol named them.",
        &[
            Series::labelled(
                "named",
                "/symbolization/counts/kernel_named",
                field!(batches.symbolize.kernel_named),
            ),
            Series::labelled(
                "unnamed",
                "/symbolization/counts/kernel_unnamed",
                field!(batches.symbolize.kernel_unnamed),
            ),
        ],
    )
    .by("result"),
    Stat::counter(
        "kallsyms_reloads",
        "Reads of kallsyms after the first: an address no symbol named, or modules or BPF \
         programs loaded or unloaded since the last read.",
        &[Series::one(
            "/symbolization/counts/kernel_reloads",
            field!(batches.symbolize.kernel_reloads),
        )],
    ),
    Stat::gauge(
        "kernel_symbols",
        "Symbols in the kernel table (0 when kallsyms is hidden).",
        &[Series::one(
            "/symbolization/counts/kernel_symbols",
            field!(batches.symbolize.kernel_symbols),
        )],
    ),
    Stat::counter(
        "symbolizer_files_opened",
        "Files handed to blazesym.",
        &[Series::one(
            "/symbolization/counts/objects_opened",
            field!(batches.symbolize.objects_opened),
        )],
    ),
    Stat::counter(
        "symbolizer_files_evicted",
        "Files blazesym let go of for the symbolizer's share of the memory budget.",
        &[Series::one(
            "/symbolization/counts/objects_evicted",
            field!(batches.symbolize.objects_evicted),
        )],
    ),
    Stat::counter(
        "symbolizer_rebuilds",
        "Times blazesym's whole state was dropped (after a panic, or to \
         release what path evictions do not reach).",
        &[Series::one(
            "/symbolization/counts/rebuilds",
            field!(batches.symbolize.rebuilds),
        )],
    ),
    Stat::counter(
        "symbolizer_panics",
        "Panics caught in blazesym.",
        &[Series::one(
            "/symbolization/counts/panics",
            field!(batches.symbolize.panics),
        )],
    ),
];

/// Read only when the group is present (an exporter runs).
fn export(t: &RunTotals) -> &crate::export::ExportStats {
    const NONE: &crate::export::ExportStats = &crate::export::ExportStats {
        batches_sent: 0,
        samples_sent: 0,
        batches_duplicate: 0,
        batches_dropped_queue_full: 0,
        samples_dropped_queue_full: 0,
        batches_rejected: 0,
        samples_rejected: 0,
        retries: 0,
        queued_batches: 0,
        queued_bytes: 0,
        queued_samples: 0,
        last_error: None,
    };
    t.export.as_ref().unwrap_or(NONE)
}

const EXPORT: &[Stat] = &[
    Stat::counter(
        "export_batches",
        "Batches leaving for the collector, by result.",
        &[
            Series::labelled("stored", "/export/batches_stored", |t| {
                let e = export(t);
                e.batches_sent.saturating_sub(e.batches_duplicate).into()
            }),
            Series::labelled("duplicate", "/export/batches_duplicate", |t| {
                export(t).batches_duplicate.into()
            }),
            Series::labelled(
                "dropped_queue_full",
                "/export/batches_dropped_queue_full",
                |t| export(t).batches_dropped_queue_full.into(),
            ),
            Series::labelled("rejected", "/export/batches_rejected", |t| {
                export(t).batches_rejected.into()
            }),
        ],
    )
    .by("result"),
    Stat::counter(
        "export_batches_acknowledged",
        "Batches the collector acknowledged (stored and duplicate).",
        &[Series::one("/export/batches_sent", |t| {
            export(t).batches_sent.into()
        })],
    )
    .reports(),
    Stat::counter(
        "export_samples",
        "Samples leaving for the collector, by result.",
        &[
            Series::labelled("sent", "/export/samples_sent", |t| {
                export(t).samples_sent.into()
            }),
            Series::labelled(
                "dropped_queue_full",
                "/export/samples_dropped_queue_full",
                |t| export(t).samples_dropped_queue_full.into(),
            ),
            Series::labelled("rejected", "/export/samples_rejected", |t| {
                export(t).samples_rejected.into()
            }),
        ],
    )
    .by("result"),
    Stat::counter(
        "export_retries",
        "Pushes that failed transiently and were tried again.",
        &[Series::one("/export/retries", |t| export(t).retries.into())],
    ),
    Stat::gauge(
        "export_queue",
        "Bytes of batches not delivered yet.",
        &[Series::one("/export/queued_bytes", |t| {
            export(t).queued_bytes.into()
        })],
    )
    .unit(StatUnit::Bytes),
    Stat::gauge(
        "export_queue_batches",
        "Batches not delivered yet.",
        &[Series::one("/export/queued_batches", |t| {
            export(t).queued_batches.into()
        })],
    ),
    Stat::gauge(
        "export_queue_samples",
        "Samples in the batches not delivered yet.",
        &[Series::one("/export/queued_samples", |t| {
            export(t).queued_samples.into()
        })],
    ),
];

/// Read only when the group is present (uploads are on).
fn uploads(t: &RunTotals) -> crate::export::debuginfo::UploadStats {
    t.uploads.unwrap_or_default()
}

const UPLOADS: &[Stat] = &[
    Stat::counter(
        "debuginfo_uploads",
        "Binaries offered for a debuginfo upload, by what became of them: \
         uploaded, already on the collector, without symbols of their own, \
         failed, or dropped because the queue was full.",
        &[
            Series::labelled("uploaded", "/debuginfo_upload/uploaded", |t| {
                uploads(t).uploaded.into()
            }),
            Series::labelled("already_stored", "/debuginfo_upload/already_stored", |t| {
                uploads(t).already_stored.into()
            }),
            Series::labelled(
                "without_symbols",
                "/debuginfo_upload/without_symbols",
                |t| uploads(t).without_symbols.into(),
            ),
            Series::labelled("failed", "/debuginfo_upload/failed", |t| {
                uploads(t).failed.into()
            }),
            Series::labelled("queue_full", "/debuginfo_upload/queue_full", |t| {
                uploads(t).queue_full.into()
            }),
        ],
    )
    .by("result"),
    Stat::counter(
        "debuginfo_uploaded",
        "Bytes of debuginfo uploaded.",
        &[Series::one("/debuginfo_upload/uploaded_bytes", |t| {
            uploads(t).uploaded_bytes.into()
        })],
    )
    .unit(StatUnit::Bytes),
];

const AGENT: &[Stat] = &[
    Stat::gauge(
        "run_time",
        "How long the agent has sampled.",
        &[Series::one("/elapsed_secs", |t| {
            t.elapsed.as_secs_f64().into()
        })],
    )
    .unit(StatUnit::Seconds)
    .reports(),
    Stat::counter(
        "process_cpu",
        "User and system CPU time spent.",
        &[Series::one(
            "/process/cpu_seconds",
            field!(process.cpu_seconds),
        )],
    )
    .unit(StatUnit::Seconds)
    .process_metrics(),
    Stat::counter(
        "sampling_thread_wakeups",
        "Times the sampling thread woke, by cause: records the BPF program \
         signalled, the drain period's end, mapping events, an interval's end, \
         the end of its wait for labels, or a message (pod list, policies, \
         gone processes, descriptions, maps read, JIT names, Python and JVM \
         finds, totals asked for); publish: the totals sent for /metrics at \
         a wake-up of another cause.",
        by_wake!(wakeups),
    )
    .by("cause"),
    Stat::counter(
        "sampling_thread_cpu",
        "The sampling thread's CPU time by what woke it (the wait's own system \
         calls included).",
        by_wake!(cpu_seconds),
    )
    .unit(StatUnit::Seconds)
    .by("cause"),
    Stat::gauge(
        "process_resident_memory",
        "Resident memory size.",
        &[Series::one(
            "/process/resident_bytes",
            field!(process.resident_bytes),
        )],
    )
    .unit(StatUnit::Bytes)
    .process_metrics(),
    Stat::gauge(
        "process_peak_resident_memory",
        "Highest resident memory size since the process started.",
        &[Series::one(
            "/process/peak_resident_bytes",
            field!(process.peak_resident_bytes),
        )],
    )
    .unit(StatUnit::Bytes)
    .process_metrics(),
];
