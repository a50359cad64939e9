//! Containers end to end (root, real podman): two containers run different
//! programs that exist only inside their images, a third copy runs on the
//! host. The agent binary, filtered in the kernel to one container, records
//! only that container's stacks, unwound and named from the container's own
//! binary; unfiltered, it labels every sample with its container; with a
//! 1-in-4 budget on a container, that container's raw samples drop about 4x
//! while its weight in the collector stays that of the unbudgeted run. The
//! collector is queried by container labels through the `stackscope` CLI.

use std::process::{Command, Stdio};

use stackscope_test_fixtures::{
    Fixture,
    containers::{Container, Image},
};
use stackscope_tests::{
    Collector, exclusive, folded, require_root, wait_success, workspace_binary,
};

/// Ticks per second per CPU: high enough that a 1-in-4 budget keeps
/// hundreds of samples, whose random spread is then a few percent.
const FREQUENCY: &str = "997";
const DURATION: &str = "5s";

/// Runs the agent for [`DURATION`] against `collector` as node `node`,
/// with `extra` arguments, and returns its JSON report.
fn run_agent(collector: &Collector, node: &str, extra: &[&str]) -> serde_json::Value {
    let agent = Command::new(workspace_binary("stackscope-agent"))
        .args(["--collector", &collector.grpc, "--node-name", node])
        .args(["--frequency", FREQUENCY, "--duration", DURATION])
        .args(["--interval", "2s", "--no-table-cache", "--json"])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    wait_success(agent)
}

/// The samples the agent took of process `tgid` (before any scaling).
fn raw_samples(report: &serde_json::Value, tgid: u32) -> u64 {
    report["top"]
        .as_array()
        .expect("top processes")
        .iter()
        .find(|p| p["tgid"] == tgid)
        .and_then(|p| p["samples"].as_u64())
        .unwrap_or(0)
}

/// Folded stacks of the samples matching `matchers`, and their total weight.
fn stacks(collector: &Collector, matchers: &str) -> (Vec<(String, u64)>, u64) {
    let text = collector.cli(&[
        "export", "--format", "folded", "--since", "10m", "--match", matchers,
    ]);
    let stacks = folded(&text);
    let total = stacks.iter().map(|(_, n)| n).sum();
    (stacks, total)
}

/// The weight of `stacks` whose frames contain `chain`.
fn weight_with(stacks: &[(String, u64)], chain: &str) -> u64 {
    stacks
        .iter()
        .filter(|(stack, _)| stack.contains(chain))
        .map(|(_, n)| n)
        .sum()
}

fn label_values(collector: &Collector, name: &str, matchers: &str) -> Vec<String> {
    let text = collector.cli(&["labels", name, "--since", "10m", "--match", matchers]);
    let mut values: Vec<String> = String::from_utf8(text)
        .expect("UTF-8 label values")
        .lines()
        .map(str::to_string)
        .collect();
    values.sort();
    values
}

#[test]
fn containers_are_filtered_in_the_kernel_labelled_and_budgeted() {
    require_root();
    let _serial = exclusive();

    // Static builds, so they run in a busybox-only image; the host copies
    // are deleted with their build directories once the image is made.
    let image = {
        let a = Fixture::compile("call_chain", &["-static"]);
        let b = Fixture::compile("other_chain", &["-static"]);
        Image::build(
            "profiled",
            &[
                (a.path.as_path(), "/app/call_chain"),
                (b.path.as_path(), "/app/other_chain"),
            ],
        )
    };
    let a = Container::run(&image, "a", &["/app/call_chain"]);
    let b = Container::run(&image, "b", &["/app/other_chain"]);
    // The same program as A's, on the host: only its container tells it apart.
    let host_fixture = Fixture::compile("call_chain", &[]);
    let host = host_fixture.start(&[]);
    let host_exe = host_fixture.path.to_str().expect("UTF-8 path").to_string();

    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());

    // 1. Only container A, selected by an id prefix, filtered in the kernel.
    let filtered = run_agent(&collector, "filtered", &["--container", &a.id[..12]]);
    assert!(
        filtered["kernel"]["filtered"].as_u64().unwrap_or(0) > 0,
        "nothing was filtered: {}",
        filtered["kernel"]
    );
    assert_eq!(
        raw_samples(&filtered, host.pid()) + raw_samples(&filtered, b.pid),
        0,
        "the host process or container B was sampled: {}",
        filtered["top"]
    );
    assert_eq!(
        label_values(&collector, "container_id", r#"node="filtered""#),
        [a.id.clone()]
    );
    assert_eq!(
        label_values(&collector, "exe", r#"node="filtered""#),
        ["/app/call_chain"],
        "only A's program, by its path inside the container"
    );
    let (only_a, total) = stacks(&collector, r#"node="filtered""#);
    assert!(total > 300, "only {total} samples of A: {only_a:?}");
    let chained = weight_with(&only_a, "main;a;b;c");
    assert!(
        chained * 100 >= total * 80,
        "only {chained} of {total} samples of A unwound and named main;a;b;c from A's own binary: {only_a:#?}"
    );

    // 2. Everything: each sample labelled with its container.
    let all = run_agent(&collector, "all", &[]);
    let of_a = format!(r#"node="all",container_id="{}""#, a.id);
    let (a_stacks, a_weight) = stacks(&collector, &of_a);
    assert!(weight_with(&a_stacks, "main;a;b;c") * 100 >= a_weight * 80);
    assert_eq!(weight_with(&a_stacks, "outer"), 0, "B's frames under A");
    let (b_stacks, b_weight) = stacks(
        &collector,
        &format!(r#"node="all",container_id="{}""#, b.id),
    );
    assert!(
        weight_with(&b_stacks, "main;outer;middle;inner") * 100 >= b_weight * 80,
        "B's samples: {b_stacks:#?}"
    );
    assert_eq!(
        weight_with(&b_stacks, "main;a;b;c"),
        0,
        "A's frames under B"
    );
    // By name, as people query it.
    let (_, a_by_name) = stacks(
        &collector,
        &format!(r#"node="all",container_name="{}""#, a.name),
    );
    assert_eq!(a_by_name, a_weight);
    let names = label_values(&collector, "container_name", r#"node="all""#);
    assert!(
        names.contains(&a.name) && names.contains(&b.name),
        "container names seen: {names:?}"
    );
    // The host's copy has no container.
    let host_match = format!(r#"node="all",exe="{host_exe}""#);
    let (_, host_weight) = stacks(&collector, &host_match);
    assert!(host_weight > 0, "the host process was not sampled");
    assert_eq!(
        label_values(&collector, "container_id", &host_match),
        Vec::<String>::new()
    );

    // 3. A at 1 in 4, selected by name: a quarter of the raw samples, the
    // same weight once the collector scales them.
    let budgeted = run_agent(
        &collector,
        "budget",
        &["--budget", &format!("container={}:4", a.name)],
    );
    assert!(budgeted["kernel"]["budgeted"].as_u64().unwrap_or(0) > 0);
    let (raw_all, raw_budget) = (raw_samples(&all, a.pid), raw_samples(&budgeted, a.pid));
    let ratio = raw_all as f64 / raw_budget.max(1) as f64;
    assert!(
        (2.8..5.6).contains(&ratio),
        "A's raw samples: {raw_all} unbudgeted, {raw_budget} at 1 in 4 (ratio {ratio:.2})"
    );
    let (_, scaled) = stacks(
        &collector,
        &format!(r#"node="budget",container_id="{}""#, a.id),
    );
    let deviation = (scaled as f64 - a_weight as f64).abs() / a_weight as f64;
    assert!(
        deviation <= 0.15,
        "A's weight at 1 in 4 is {scaled}, unbudgeted {a_weight}: {:.1}% apart",
        100.0 * deviation
    );
    // B kept every tick.
    let (_, b_budget_run) = stacks(
        &collector,
        &format!(r#"node="budget",container_id="{}""#, b.id),
    );
    assert_eq!(b_budget_run, raw_samples(&budgeted, b.pid));
    eprintln!(
        "A: {raw_all} raw samples unbudgeted, {raw_budget} at 1 in 4 (ratio {ratio:.2}); \
         weight {a_weight} vs {scaled} ({:.1}% apart)",
        100.0 * deviation
    );

    collector.stop();
}
