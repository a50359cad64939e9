//! `stackscope`: query a collector from the terminal. Asks the collector's
//! gRPC query service for a merged call tree (or label lists) and renders it
//! here, with the same renderers the collector's HTTP API uses.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context as _;

mod upload;
use clap::{Args, Parser, Subcommand, ValueEnum};
use stackscope_collector_client::connect::{self, TlsConfig};
use stackscope_profile::timespec::{self, SelectionText};
use stackscope_profile::{
    model::{ProfileType, Selection},
    render::{self, SvgOptions},
    selector,
    tree::CallTree,
};
use stackscope_proto::v1::{
    FlamegraphRequest, LabelNamesRequest, LabelValuesRequest, ProfileTypesRequest,
    SampleSeriesRequest, query_client::QueryClient,
};
use tonic::{
    codec::CompressionEncoding,
    metadata::{Ascii, MetadataValue},
    service::{Interceptor, interceptor::InterceptedService},
    transport::Channel,
};

/// Query flamegraphs and top functions from a stackscope collector.
#[derive(Debug, Parser)]
#[command(name = "stackscope", version)]
struct Cli {
    /// The collector's gRPC address.
    #[arg(
        long,
        global = true,
        env = "STACKSCOPE_COLLECTOR",
        default_value = "http://127.0.0.1:7070"
    )]
    collector: String,
    /// PEM CA certificate to verify an https collector (default: system roots).
    #[arg(long, global = true)]
    ca_cert: Option<PathBuf>,
    /// Give up on a query after this long.
    #[arg(long, global = true, default_value = "60s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// File holding the bearer token the collector asks queries for (its
    /// --query-token-file).
    #[arg(
        long,
        global = true,
        env = "STACKSCOPE_TOKEN_FILE",
        value_name = "FILE"
    )]
    token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write an SVG flamegraph of the selected samples (--group-by pod shows
    /// each pod side by side).
    Flamegraph {
        #[command(flatten)]
        selection: SelectionArgs,
        /// Leave out frames below this share of all samples (0.05 = 5%).
        #[arg(long, default_value_t = 0.0)]
        min_share: f64,
        /// Split the flamegraph by this label (e.g. pod, container_name):
        /// under the root, one frame `LABEL=VALUE` per value holds that
        /// value's stacks; samples without the label go under `LABEL (none)`.
        /// At most 200 values; narrow the selection for more.
        #[arg(long, value_name = "LABEL")]
        group_by: Option<String>,
        /// Title drawn on the flamegraph.
        #[arg(long)]
        title: Option<String>,
        /// Output file ("-" for stdout).
        #[arg(short, long, default_value = "flamegraph.svg")]
        output: PathBuf,
    },
    /// Print the functions with the most samples (self and total).
    Top {
        #[command(flatten)]
        selection: SelectionArgs,
        /// How many functions to list.
        #[arg(long, short = 'n', default_value_t = 20)]
        limit: usize,
    },
    /// Print who calls a function and what it calls, with their weights.
    Callers {
        /// The function name, as the flamegraph shows it.
        function: String,
        #[command(flatten)]
        selection: SelectionArgs,
    },
    /// Write a differential flamegraph: the selection against a baseline.
    Diff {
        #[command(flatten)]
        selection: SelectionArgs,
        /// Baseline matchers (default: --match).
        #[arg(long)]
        base_match: Option<String>,
        /// Baseline: the last DURATION before --base-end.
        #[arg(long)]
        base_since: Option<String>,
        /// Baseline start.
        #[arg(long)]
        base_start: Option<String>,
        /// Baseline end (default: now).
        #[arg(long)]
        base_end: Option<String>,
        /// Output file ("-" for stdout).
        #[arg(short, long, default_value = "diff.svg")]
        output: PathBuf,
    },
    /// Print the selected samples' weight over time, a line per step:
    /// `<start, RFC 3339> <weight>` (steps without samples left out).
    Series {
        #[command(flatten)]
        selection: SelectionArgs,
        /// Width of each step (e.g. 10s, 5m). Default: the collector picks
        /// about 100 steps over the range.
        #[arg(long, value_parser = humantime::parse_duration)]
        step: Option<Duration>,
    },
    /// List the profile types with samples in the selection's time range.
    Types {
        #[command(flatten)]
        selection: SelectionArgs,
    },
    /// List label names, or the values of one label.
    Labels {
        /// A label name: list its values.
        name: Option<String>,
        #[command(flatten)]
        selection: SelectionArgs,
    },
    /// Export the selected samples for other tools.
    Export {
        #[command(flatten)]
        selection: SelectionArgs,
        #[arg(long, value_enum)]
        format: ExportFormat,
        /// Split the flamegraph by this label (e.g. pod, container_name):
        /// under the root, one frame `LABEL=VALUE` per value holds that
        /// value's stacks; samples without the label go under `LABEL (none)`.
        /// At most 200 values; narrow the selection for more.
        #[arg(long, value_name = "LABEL")]
        group_by: Option<String>,
        /// Output file ("-" for stdout).
        #[arg(short, long, default_value = "-")]
        output: PathBuf,
    },
    /// Debuginfo the collector names stripped binaries' frames with.
    Debuginfo {
        #[command(subcommand)]
        command: DebuginfoCommand,
    },
}

#[derive(Debug, Subcommand)]
enum DebuginfoCommand {
    /// Send files' symbols and DWARF to the collector, once per build-id
    /// for the whole fleet: unstripped binaries, or separate debug files
    /// (`objcopy --only-keep-debug`, `/usr/lib/debug/.build-id/...`).
    /// Profiles already stored show the names at their next query.
    Upload {
        /// ELF files carrying a build-id and a symbol table or DWARF.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// File holding the collector's bearer token (its
        /// --ingest-token-file).
        #[arg(long)]
        token_file: Option<PathBuf>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ExportFormat {
    /// Gzipped profile.proto, for `go tool pprof`.
    Pprof,
    /// One line per stack: `main;a;b 42`.
    Folded,
    /// The call tree as nested JSON.
    Json,
}

#[derive(Debug, Args)]
struct SelectionArgs {
    /// Label matchers, as in PromQL: 'comm="redis-server",exe=~".*/redis.*"'.
    #[arg(long = "match", short = 'm')]
    matchers: Option<String>,
    /// The profile type: cpu (time on the CPU, the default), off-cpu (time
    /// blocked), or the id of a type applications send with Pyroscope's
    /// SDKs (memory:alloc_space:bytes:space:bytes; `stackscope types` lists
    /// them).
    #[arg(long = "type", value_name = "TYPE")]
    profile_type: Option<String>,
    /// The last DURATION (e.g. 5m, 2h). Default: 1h.
    #[arg(long, conflicts_with = "start")]
    since: Option<String>,
    /// Start: RFC 3339 time, Unix seconds, or a duration ago.
    #[arg(long)]
    start: Option<String>,
    /// End: same forms as --start. Default: now.
    #[arg(long)]
    end: Option<String>,
}

impl SelectionArgs {
    fn text(&self) -> SelectionText<'_> {
        SelectionText {
            matchers: self.matchers.as_deref(),
            profile_type: self.profile_type.as_deref(),
            since: self.since.as_deref(),
            start: self.start.as_deref(),
            end: self.end.as_deref(),
        }
    }

    fn selection(&self) -> anyhow::Result<Selection> {
        Ok(self.text().parse()?)
    }
}

struct Collector {
    client: QueryClient<InterceptedService<Channel, QueryToken>>,
    address: String,
}

/// Adds `authorization: Bearer <token>` to every query when a token is
/// given.
#[derive(Clone)]
struct QueryToken(Option<MetadataValue<Ascii>>);

impl Interceptor for QueryToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// A channel to the collector at `--collector`.
async fn connect_channel(cli: &Cli) -> anyhow::Result<Channel> {
    let tls = cli.ca_cert.clone().map(|ca_cert| TlsConfig {
        ca_cert: Some(ca_cert),
        ..TlsConfig::default()
    });
    let endpoint = connect::endpoint(&cli.collector, tls.as_ref(), Duration::from_secs(10))
        .context("--collector and --ca-cert")?
        .timeout(cli.timeout);
    endpoint.connect().await.with_context(|| {
        format!(
            "cannot reach the collector at {}: is stackscope-collector running there? \
             (set --collector or STACKSCOPE_COLLECTOR)",
            cli.collector
        )
    })
}

impl Collector {
    async fn connect(cli: &Cli) -> anyhow::Result<Self> {
        let channel = connect_channel(cli).await?;
        let token = match &cli.token_file {
            Some(path) => {
                let token = upload::read_token(path)?;
                connect::authorization(Some(&token))
                    .with_context(|| format!("the token in {}", path.display()))?
            }
            None => None,
        };
        let client = QueryClient::with_interceptor(channel, QueryToken(token))
            .accept_compressed(CompressionEncoding::Zstd)
            .accept_compressed(CompressionEncoding::Gzip)
            .max_decoding_message_size(256 << 20);
        Ok(Self {
            client,
            address: cli.collector.clone(),
        })
    }

    fn failed(&self, status: tonic::Status) -> anyhow::Error {
        anyhow::anyhow!(
            "the collector at {} answered {:?}: {}",
            self.address,
            status.code(),
            status.message()
        )
    }

    /// The merged call tree of `selection` (split by the `group_by` label
    /// when given) and the sample period; an error says so when nothing
    /// matches (every command needs samples).
    async fn tree(
        &mut self,
        selection: &Selection,
        min_share: f64,
        group_by: Option<&str>,
    ) -> anyhow::Result<(CallTree, u64)> {
        let response = self
            .client
            .flamegraph(FlamegraphRequest {
                selection: Some(selector::selection_to_proto(selection)),
                min_share,
                group_by: group_by.unwrap_or_default().to_owned(),
            })
            .await
            .map_err(|status| self.failed(status))?
            .into_inner();
        // A collector from before profile types ignores the one asked for
        // and answers CPU samples.
        let answered = match response.profile_type.as_str() {
            "" => ProfileType::Cpu,
            name => ProfileType::from_name(name).unwrap_or_else(|| selection.profile_type.clone()),
        };
        if answered != selection.profile_type {
            anyhow::bail!(
                "{} answered {answered} samples, not the {} asked for: it predates profile \
                 types; upgrade it",
                self.address,
                selection.profile_type
            );
        }
        let tree = CallTree::from_proto(&response)
            .context("the collector sent an inconsistent call tree")?;
        if tree.total() == 0 {
            return Err(no_samples(selection));
        }
        Ok((tree, response.sample_period_nanos))
    }
}

/// Connects and fetches one selection's tree (see [`Collector::tree`]).
async fn fetch_tree(
    cli: &Cli,
    selection: &Selection,
    min_share: f64,
    group_by: Option<&str>,
) -> anyhow::Result<(CallTree, u64)> {
    if let Some(label) = group_by
        && !selector::is_valid_label_name(label)
    {
        anyhow::bail!(
            "--group-by {label:?} is not a label name (letters, digits and _, not starting \
             with a digit); `stackscope labels` lists them"
        );
    }
    Collector::connect(cli)
        .await?
        .tree(selection, min_share, group_by)
        .await
}

fn write_output(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if path == Path::new("-") {
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(bytes).context("writing to stdout")?;
        return stdout.flush().context("writing to stdout");
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// Samples in a tree, for messages.
fn no_samples(selection: &Selection) -> anyhow::Error {
    anyhow::anyhow!(
        "no samples match {} in that time range; check the time range (--since, --start) and \
         `stackscope labels` for the label values the collector has",
        timespec::describe(selection)
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match &cli.command {
        Command::Flamegraph {
            selection: args,
            min_share,
            group_by,
            title,
            output,
        } => {
            if !(0.0..=1.0).contains(min_share) {
                anyhow::bail!("--min-share must be between 0 and 1 (0.05 = 5%)");
            }
            let selection = args.selection()?;
            let (tree, _) = fetch_tree(&cli, &selection, *min_share, group_by.as_deref()).await?;
            let options = SvgOptions::titled(
                title.clone().unwrap_or_else(|| timespec::title(&selection)),
                &selection.profile_type,
            );
            write_output(output, &render::svg(&tree, &options)?)?;
            if output != Path::new("-") {
                eprintln!("wrote {} ({} samples)", output.display(), tree.total());
            }
        }
        Command::Top {
            selection: args,
            limit,
        } => {
            let selection = args.selection()?;
            let (tree, _) = fetch_tree(&cli, &selection, 0.0, None).await?;
            let top = render::top_functions(&tree, *limit);
            print!("{}", render::text_top(&top, tree.total()));
        }
        Command::Callers {
            function,
            selection: args,
        } => {
            let selection = args.selection()?;
            let (tree, _) = fetch_tree(&cli, &selection, 0.0, None).await?;
            let report = render::callers_callees(&tree, function);
            if report.total == 0 {
                anyhow::bail!(
                    "no samples pass through {function:?} in {}; `stackscope top` lists the \
                     functions seen",
                    timespec::describe(&selection)
                );
            }
            print!("{}", render::text_callers_callees(&report, tree.total()));
        }
        Command::Diff {
            selection: args,
            base_match,
            base_since,
            base_start,
            base_end,
            output,
        } => {
            let selection = args.selection()?;
            let base = args
                .text()
                .baseline(SelectionText {
                    matchers: base_match.as_deref(),
                    since: base_since.as_deref(),
                    start: base_start.as_deref(),
                    end: base_end.as_deref(),
                    ..SelectionText::default()
                })
                .parse()
                .context("baseline")?;
            let mut collector = Collector::connect(&cli).await?;
            let (new, _) = collector.tree(&selection, 0.0, None).await?;
            let (old, _) = collector.tree(&base, 0.0, None).await.context("baseline")?;
            let options = SvgOptions::titled(
                timespec::diff_title(&selection, &base),
                &selection.profile_type,
            );
            write_output(output, &render::diff_svg(&old, &new, &options)?)?;
            if output != Path::new("-") {
                eprintln!("wrote {}", output.display());
            }
        }
        Command::Series {
            selection: args,
            step,
        } => {
            let selection = selector::selection_to_proto(&args.selection()?);
            let step_nanos = match step {
                Some(step) => i64::try_from(step.as_nanos())
                    .ok()
                    .filter(|&nanos| nanos > 0)
                    .context("--step must be between 1ns and about 292 years")?,
                None => 0,
            };
            let mut collector = Collector::connect(&cli).await?;
            let request = SampleSeriesRequest {
                selection: Some(selection),
                step_nanos,
            };
            let points = match collector.client.sample_series(request).await {
                Ok(response) => response.into_inner().points,
                Err(status) => return Err(collector.failed(status)),
            };
            for point in points {
                let start = std::time::UNIX_EPOCH
                    + Duration::from_nanos(u64::try_from(point.start_unix_nanos).unwrap_or(0));
                println!(
                    "{} {}",
                    humantime::format_rfc3339_seconds(start),
                    point.weight
                );
            }
        }
        Command::Types { selection: args } => {
            let request = ProfileTypesRequest {
                selection: Some(selector::selection_to_proto(&args.selection()?)),
            };
            let mut collector = Collector::connect(&cli).await?;
            match collector.client.profile_types(request).await {
                Ok(response) => {
                    for name in response.into_inner().types {
                        println!("{name}");
                    }
                }
                Err(status) => return Err(collector.failed(status)),
            }
        }
        Command::Labels {
            name,
            selection: args,
        } => {
            let selection = selector::selection_to_proto(&args.selection()?);
            let mut collector = Collector::connect(&cli).await?;
            let lines = match name {
                None => {
                    let request = LabelNamesRequest {
                        selection: Some(selection),
                    };
                    match collector.client.label_names(request).await {
                        Ok(response) => response.into_inner().names,
                        Err(status) => return Err(collector.failed(status)),
                    }
                }
                Some(name) => {
                    let request = LabelValuesRequest {
                        selection: Some(selection),
                        name: name.clone(),
                    };
                    match collector.client.label_values(request).await {
                        Ok(response) => response.into_inner().values,
                        Err(status) => return Err(collector.failed(status)),
                    }
                }
            };
            for line in lines {
                println!("{line}");
            }
        }
        Command::Export {
            selection: args,
            format,
            group_by,
            output,
        } => {
            let selection = args.selection()?;
            let (tree, period) = fetch_tree(&cli, &selection, 0.0, group_by.as_deref()).await?;
            let bytes = match format {
                ExportFormat::Pprof => render::pprof(
                    &tree,
                    &selection.profile_type,
                    period,
                    selection.range.start_unix_nanos,
                    selection.range.end_unix_nanos - selection.range.start_unix_nanos,
                ),
                ExportFormat::Folded => render::folded(&tree).into_bytes(),
                ExportFormat::Json => {
                    let mut json = serde_json::to_vec_pretty(&render::json(&tree))?;
                    json.push(b'\n');
                    json
                }
            };
            write_output(output, &bytes)?;
        }
        Command::Debuginfo {
            command: DebuginfoCommand::Upload { files, token_file },
        } => {
            let token = token_file.as_deref().map(upload::read_token).transpose()?;
            let channel = connect_channel(&cli).await?;
            upload::upload_files(channel, token, files, &cli.collector).await?;
        }
    }
    Ok(())
}
