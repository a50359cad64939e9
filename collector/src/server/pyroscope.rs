//! Grafana Pyroscope's APIs on the collector's HTTP port, so Grafana's
//! Pyroscope data source queries stackscope and Pyroscope's SDKs send to it
//! unchanged:
//!
//! - `querier.v1.QuerierService` (behind the query token): `ProfileTypes`,
//!   `LabelNames`, `LabelValues`, `Series`, `SelectMergeStacktraces`,
//!   `SelectMergeProfile`, `SelectSeries` and `GetProfileStats`, as Connect
//!   unary calls (`connect`);
//! - `push.v1.PusherService/Push` and `POST /ingest` (behind the ingest
//!   token): pprof profiles (and, on `/ingest`, folded stacks), stored by
//!   `ingest::pprof`.
//!
//! Times are Unix milliseconds; selections are `{name="value", ...}`, with
//! the profile type as the call's `profile_typeID` or, as Grafana's editors
//! also write it, an id before the braces, a `__profile_type__` matcher or a
//! `__name__` matcher holding a whole id (or a profile's name). CPU weights
//! are answered in nanoseconds, each sample's ticks times its own period
//! (agents at 19 Hz and an SDK at 100 Hz in one answer).

use std::{collections::BTreeMap, sync::Arc};

use axum::{
    Router,
    body::Bytes,
    extract::{DefaultBodyLimit, FromRequest as _, Multipart, Path, Query, Request, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use prost::Message as _;
use serde::Deserialize;
use stackscope_profile::{
    model::{LabelMatcher, MatchOp, ProfileType, PyroscopeTypeId, Selection, TimeRange},
    render,
    selector::parse_matchers,
    tree::CallTree,
};
use stackscope_proto::{
    pprof,
    pyroscope::{
        google::v1 as google,
        push::v1::{PushRequest, PushResponse},
        querier::v1 as querier,
        types::v1 as types,
    },
};

use super::{
    connect::{Code, ConnectError, decode, decompressed, respond},
    store::{SentIngest, SentRefusal},
};
use crate::{
    ingest::pprof::{MAX_PROFILES_PER_REQUEST, SentProfile},
    query::{Fault, MAX_GROUPS, QueryEngine, QueryError},
    storage::IngestOutcome,
};

/// Largest request the querier takes (its requests are a few selectors).
const MAX_QUERY_BYTES: usize = 1 << 20;

/// Nodes a flame graph has when the call does not bound them: Pyroscope's
/// default.
const DEFAULT_MAX_NODES: i64 = 8192;
/// The most a call may ask for: Pyroscope's bound.
const MAX_MAX_NODES: i64 = 1 << 20;

/// The querier's routes (behind the query token).
pub fn querier_router(engine: QueryEngine) -> Router {
    Router::new()
        .route("/querier.v1.QuerierService/{method}", post(querier_call))
        .with_state(engine)
}

/// The SDKs' routes (behind the ingest token).
pub fn ingest_router(state: SentIngest) -> Router {
    let max_bytes = state.max_bytes;
    Router::new()
        .route("/push.v1.PusherService/Push", post(push))
        .route("/ingest", post(ingest))
        .layer(DefaultBodyLimit::max(max_bytes))
        .with_state(state)
}

fn query_error(err: QueryError) -> ConnectError {
    match err.into_public() {
        (Fault::Request, message) => ConnectError::invalid(message),
        (Fault::Collector, message) => ConnectError::new(Code::Internal, message),
    }
}

/// Decodes a call's request, answers it with `answer`, encodes the answer.
async fn unary<Req, Resp, F>(
    headers: &HeaderMap,
    body: Bytes,
    names: (&str, &str),
    answer: impl FnOnce(Req) -> F,
) -> Response
where
    Req: prost::Message + Default,
    Resp: prost::Message,
    F: Future<Output = Result<Resp, ConnectError>>,
{
    let (request, encoding) = match decode::<Req>(headers, body, names.0, MAX_QUERY_BYTES) {
        Ok(decoded) => decoded,
        Err(err) => return err.into_response(),
    };
    match answer(request).await {
        Ok(response) => respond(&response, names.1, encoding),
        Err(err) => err.into_response(),
    }
}

async fn querier_call(
    State(engine): State<QueryEngine>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let engine = &engine;
    // A call: its handler and its request's and answer's message names.
    macro_rules! answer {
        ($handler:ident, $request:literal, $response:literal) => {
            unary(&headers, body, ($request, $response), |r| {
                $handler(engine, r)
            })
            .await
        };
    }
    match method.as_str() {
        "ProfileTypes" => answer!(
            profile_types,
            "querier.v1.ProfileTypesRequest",
            "querier.v1.ProfileTypesResponse"
        ),
        "LabelNames" => answer!(
            label_names,
            "types.v1.LabelNamesRequest",
            "types.v1.LabelNamesResponse"
        ),
        "LabelValues" => answer!(
            label_values,
            "types.v1.LabelValuesRequest",
            "types.v1.LabelValuesResponse"
        ),
        "Series" => answer!(
            series,
            "querier.v1.SeriesRequest",
            "querier.v1.SeriesResponse"
        ),
        "SelectMergeStacktraces" => answer!(
            select_merge_stacktraces,
            "querier.v1.SelectMergeStacktracesRequest",
            "querier.v1.SelectMergeStacktracesResponse"
        ),
        "SelectMergeProfile" => answer!(
            select_merge_profile,
            "querier.v1.SelectMergeProfileRequest",
            "google.v1.Profile"
        ),
        "SelectSeries" => answer!(
            select_series,
            "querier.v1.SelectSeriesRequest",
            "querier.v1.SelectSeriesResponse"
        ),
        "GetProfileStats" => answer!(
            profile_stats,
            "types.v1.GetProfileStatsRequest",
            "types.v1.GetProfileStatsResponse"
        ),
        "SelectMergeSpanProfile" | "SelectHeatmap" => ConnectError::new(
            Code::Unimplemented,
            format!(
                "{method} is not answered by stackscope: its profiles carry no span ids and \
                 it keeps no per-profile values for heatmaps"
            ),
        )
        .into_response(),
        _ => ConnectError::no_procedure(&format!("/querier.v1.QuerierService/{method}"))
            .into_response(),
    }
}

/// Unix milliseconds `[start, end)` as a range; an empty or reversed one
/// selects nothing.
fn time_range(start_ms: i64, end_ms: i64) -> TimeRange {
    let nanos = |ms: i64| ms.saturating_mul(1_000_000);
    TimeRange {
        start_unix_nanos: nanos(start_ms),
        end_unix_nanos: nanos(end_ms),
    }
}

/// A selector as Grafana writes it: `{a="b",...}`, possibly after a
/// profile type id, possibly naming the type with `__profile_type__` or a
/// whole id as `__name__`, or only the profile's name (`__name__="memory"`).
struct ParsedSelector {
    /// The matchers on labels.
    matchers: Vec<LabelMatcher>,
    /// The type it names, if any.
    profile_type: Option<ProfileType>,
    /// The profile name (an id's first part) it asks for, if any.
    profile_name: Option<String>,
}

impl ParsedSelector {
    /// Whether a type is one the selector allows.
    fn allows(&self, profile_type: &ProfileType) -> bool {
        let name = profile_type.pyroscope_id().split(':').next().unwrap_or("");
        self.profile_type.as_ref().is_none_or(|t| t == profile_type)
            && self.profile_name.as_deref().is_none_or(|n| n == name)
    }
}

fn parse_selector(text: &str) -> Result<ParsedSelector, ConnectError> {
    let text = text.trim();
    let (prefix, braces) = match text.find('{') {
        Some(at) => text.split_at(at),
        None if text.is_empty() => ("", ""),
        None => (text, ""),
    };
    let mut parsed = ParsedSelector {
        matchers: Vec::new(),
        profile_type: None,
        profile_name: None,
    };
    let name_type = |parsed: &mut ParsedSelector, name: &str| -> Result<(), ConnectError> {
        let profile_type = ProfileType::from_name(name)
            .ok_or_else(|| ConnectError::invalid(format!("unknown profile type {name:?}")))?;
        if parsed
            .profile_type
            .as_ref()
            .is_some_and(|t| *t != profile_type)
        {
            return Err(ConnectError::invalid(format!(
                "the selector {text:?} names two profile types"
            )));
        }
        parsed.profile_type = Some(profile_type);
        Ok(())
    };
    if !prefix.trim().is_empty() {
        name_type(&mut parsed, prefix.trim())?;
    }
    let matchers = parse_matchers(braces)
        .map_err(|err| ConnectError::invalid(format!("label selector {text:?}: {err}")))?;
    for matcher in matchers {
        let equal = matcher.op == MatchOp::Equal;
        match matcher.name.as_str() {
            "__profile_type__" if equal => name_type(&mut parsed, &matcher.value)?,
            "__name__" if equal && matcher.value.split(':').count() == 5 => {
                name_type(&mut parsed, &matcher.value)?;
            }
            "__name__" if equal => parsed.profile_name = Some(matcher.value),
            name if name.starts_with("__") => {
                return Err(ConnectError::invalid(format!(
                    "label selector {text:?}: {}{}{:?} is not a matcher stackscope answers \
                     (among the __ labels: __profile_type__=\"<id>\" and __name__=\"<name>\")",
                    matcher.name,
                    matcher.op.as_str(),
                    matcher.value
                )));
            }
            _ => parsed.matchers.push(matcher),
        }
    }
    Ok(parsed)
}

/// The selection of a call that names one profile type.
fn typed_selection(
    profile_type_id: &str,
    label_selector: &str,
    start_ms: i64,
    end_ms: i64,
) -> Result<Selection, ConnectError> {
    let parsed = parse_selector(label_selector)?;
    let profile_type = match (profile_type_id.trim(), parsed.profile_type.clone()) {
        ("", Some(named)) => named,
        ("", None) => return Err(ConnectError::invalid("profile_typeID is missing")),
        (id, named) => {
            let given = ProfileType::from_name(id)
                .ok_or_else(|| ConnectError::invalid(format!("unknown profile type {id:?}")))?;
            if named.is_some_and(|named| named != given) {
                return Err(ConnectError::invalid(
                    "profile_typeID and the label selector name different types",
                ));
            }
            given
        }
    };
    if !parsed.allows(&profile_type) {
        return Err(ConnectError::invalid(format!(
            "the label selector's __name__ is not the name of {}",
            profile_type.pyroscope_id()
        )));
    }
    Ok(Selection {
        range: time_range(start_ms, end_ms),
        matchers: parsed.matchers,
        profile_type,
    })
}

/// The selections of a call over label selectors that may leave the type
/// out (then every type present is selected): one per (selector, type).
async fn untyped_selections(
    engine: &QueryEngine,
    selectors: &[String],
    start_ms: i64,
    end_ms: i64,
) -> Result<Vec<Selection>, ConnectError> {
    let range = time_range(start_ms, end_ms);
    let everything = [String::new()];
    let selectors = if selectors.is_empty() {
        &everything[..]
    } else {
        selectors
    };
    let mut selections = Vec::new();
    for selector in selectors {
        let parsed = parse_selector(selector)?;
        let selection = Selection {
            range,
            matchers: parsed.matchers.clone(),
            profile_type: ProfileType::Cpu,
        };
        let mut types = match &parsed.profile_type {
            Some(named) => vec![named.clone()],
            None => engine
                .profile_types(selection.clone())
                .await
                .map_err(query_error)?,
        };
        types.retain(|t| parsed.allows(t));
        selections.extend(types.into_iter().map(|profile_type| Selection {
            profile_type,
            ..selection.clone()
        }));
    }
    Ok(selections)
}

fn pyroscope_type(profile_type: &ProfileType) -> types::ProfileType {
    let id = profile_type.pyroscope_id();
    let mut parts = id.split(':').map(str::to_owned);
    let mut part = || parts.next().unwrap_or_default();
    types::ProfileType {
        id: id.to_owned(),
        name: part(),
        sample_type: part(),
        sample_unit: part(),
        period_type: part(),
        period_unit: part(),
    }
}

async fn profile_types(
    engine: &QueryEngine,
    request: querier::ProfileTypesRequest,
) -> Result<querier::ProfileTypesResponse, ConnectError> {
    let selection = Selection {
        range: time_range(request.start, request.end),
        matchers: Vec::new(),
        profile_type: ProfileType::Cpu,
    };
    let present = engine.profile_types(selection).await.map_err(query_error)?;
    let mut profile_types: Vec<_> = present.iter().map(pyroscope_type).collect();
    // Pyroscope lists them by id.
    profile_types.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(querier::ProfileTypesResponse { profile_types })
}

/// Most label sets a `Series` call answers (Profiles Drilldown lists every
/// service and type with it).
const MAX_SERIES: usize = 10_000;

/// The labels Pyroscope has on every series that stackscope keeps apart.
const PROFILE_TYPE_NAMES: [&str; 2] = ["__profile_type__", "__name__"];

async fn label_names(
    engine: &QueryEngine,
    request: types::LabelNamesRequest,
) -> Result<types::LabelNamesResponse, ConnectError> {
    let mut names = std::collections::BTreeSet::new();
    for selection in
        untyped_selections(engine, &request.matchers, request.start, request.end).await?
    {
        names.extend(engine.label_names(selection).await.map_err(query_error)?);
    }
    if !names.is_empty() {
        names.extend(PROFILE_TYPE_NAMES.map(str::to_owned));
    }
    Ok(types::LabelNamesResponse {
        names: names.into_iter().collect(),
    })
}

/// The value a selection's type gives a label of [`PROFILE_TYPE_NAMES`].
fn type_label(selection: &Selection, name: &str) -> String {
    let id = selection.profile_type.pyroscope_id();
    match name {
        "__name__" => id.split(':').next().unwrap_or("").to_owned(),
        _ => id.to_owned(),
    }
}

async fn label_values(
    engine: &QueryEngine,
    request: types::LabelValuesRequest,
) -> Result<types::LabelValuesResponse, ConnectError> {
    let mut values = std::collections::BTreeSet::new();
    for selection in
        untyped_selections(engine, &request.matchers, request.start, request.end).await?
    {
        if PROFILE_TYPE_NAMES.contains(&request.name.as_str()) {
            values.insert(type_label(&selection, &request.name));
        } else {
            values.extend(
                engine
                    .label_values(selection, request.name.clone())
                    .await
                    .map_err(query_error)?,
            );
        }
    }
    Ok(types::LabelValuesResponse {
        names: values.into_iter().collect(),
    })
}

/// The distinct combinations of `names`' values among the selected
/// samples, as label pairs (a name a sample lacks is left out), each with
/// the selection of its samples; at most `max`.
async fn combinations(
    engine: &QueryEngine,
    selection: &Selection,
    names: &[String],
    max: usize,
) -> Result<Vec<(Selection, Vec<types::LabelPair>)>, ConnectError> {
    // Each step splits every combination so far by the next name's values
    // among its samples.
    let mut combinations: Vec<(Selection, Vec<types::LabelPair>)> =
        vec![(selection.clone(), Vec::new())];
    for name in names {
        let mut next = Vec::new();
        for (selection, pairs) in combinations {
            if PROFILE_TYPE_NAMES.contains(&name.as_str()) {
                let value = type_label(&selection, name);
                let mut pairs = pairs;
                pairs.push(types::LabelPair {
                    name: name.clone(),
                    value,
                });
                next.push((selection, pairs));
                continue;
            }
            let values = engine
                .label_values(selection.clone(), name.clone())
                .await
                .map_err(query_error)?;
            // Samples without the label form a combination of their own.
            let absent = LabelMatcher::new(name.clone(), MatchOp::Equal, "").expect("= compiles");
            let mut without = selection.clone();
            without.matchers.push(absent);
            if !engine
                .label_names(without.clone())
                .await
                .map_err(query_error)?
                .is_empty()
            {
                next.push((without, pairs.clone()));
            }
            for value in values {
                let mut narrowed = selection.clone();
                narrowed.matchers.push(
                    LabelMatcher::new(name.clone(), MatchOp::Equal, value.clone())
                        .expect("= compiles"),
                );
                let mut pairs = pairs.clone();
                pairs.push(types::LabelPair {
                    name: name.clone(),
                    value,
                });
                next.push((narrowed, pairs));
            }
            if next.len() > max {
                return Err(ConnectError::invalid(format!(
                    "more than {max} combinations of {names:?}: narrow the selection"
                )));
            }
        }
        combinations = next;
    }
    Ok(combinations)
}

async fn series(
    engine: &QueryEngine,
    request: querier::SeriesRequest,
) -> Result<querier::SeriesResponse, ConnectError> {
    let mut labels_set = Vec::new();
    for selection in
        untyped_selections(engine, &request.matchers, request.start, request.end).await?
    {
        let names = if request.label_names.is_empty() {
            let mut names = engine
                .label_names(selection.clone())
                .await
                .map_err(query_error)?;
            names.extend(PROFILE_TYPE_NAMES.map(str::to_owned));
            names
        } else {
            request.label_names.clone()
        };
        for (_, mut labels) in combinations(engine, &selection, &names, MAX_SERIES).await? {
            labels.sort_by(|a, b| a.name.cmp(&b.name));
            labels_set.push(types::Labels { labels });
        }
    }
    labels_set.sort_by(|a, b| {
        let key = |l: &types::Labels| {
            l.labels
                .iter()
                .map(|p| (p.name.clone(), p.value.clone()))
                .collect::<Vec<_>>()
        };
        key(a).cmp(&key(b))
    });
    labels_set.dedup();
    Ok(querier::SeriesResponse { labels_set })
}

fn max_nodes(asked: Option<i64>) -> Result<usize, ConnectError> {
    match asked {
        None | Some(0) => Ok(DEFAULT_MAX_NODES as usize),
        Some(n) if (1..=MAX_MAX_NODES).contains(&n) => Ok(n as usize),
        Some(n) => Err(ConnectError::invalid(format!(
            "max_nodes {n} is not in 0..={MAX_MAX_NODES}"
        ))),
    }
}

/// The selection's tree in its type's unit (CPU time in nanoseconds,
/// each sample by its own period).
async fn merged_tree(engine: &QueryEngine, selection: Selection) -> Result<CallTree, ConnectError> {
    let flamegraph = engine
        .flamegraph_in_units(selection)
        .await
        .map_err(query_error)?;
    Ok(flamegraph.tree)
}

async fn select_merge_stacktraces(
    engine: &QueryEngine,
    request: querier::SelectMergeStacktracesRequest,
) -> Result<querier::SelectMergeStacktracesResponse, ConnectError> {
    let flame_graph_formats = [
        querier::ProfileFormat::Unspecified as i32,
        querier::ProfileFormat::Flamegraph as i32,
    ];
    if !flame_graph_formats.contains(&request.format) {
        return Err(ConnectError::new(
            Code::Unimplemented,
            "only the flame graph format (PROFILE_FORMAT_FLAMEGRAPH) is answered",
        ));
    }
    refuse_narrowing(
        request.stack_trace_selector.as_ref(),
        &request.profile_id_selector,
        &request.trace_id_selector,
        &request.span_selector,
    )?;
    let max_nodes = max_nodes(request.max_nodes)?;
    let selection = typed_selection(
        &request.profile_type_id,
        &request.label_selector,
        request.start,
        request.end,
    )?;
    let tree = merged_tree(engine, selection).await?;
    let levels = render::flame_graph_levels(&tree, max_nodes, 1);
    Ok(querier::SelectMergeStacktracesResponse {
        flamegraph: Some(querier::FlameGraph {
            names: levels.names,
            levels: levels
                .levels
                .into_iter()
                .map(|values| querier::Level { values })
                .collect(),
            total: levels.total,
            max_self: levels.max_self,
        }),
        ..Default::default()
    })
}

/// Selections by stack, profile, trace or span are Pyroscope's; stackscope
/// keeps none of what they select by, so it says so rather than answer
/// for every sample.
fn refuse_narrowing(
    stack_trace_selector: Option<&types::StackTraceSelector>,
    profile_ids: &[String],
    trace_ids: &[String],
    span_ids: &[String],
) -> Result<(), ConnectError> {
    let by_stack = stack_trace_selector
        .is_some_and(|selector| !selector.call_site.is_empty() || selector.go_pgo.is_some());
    if by_stack || !profile_ids.is_empty() || !trace_ids.is_empty() || !span_ids.is_empty() {
        return Err(ConnectError::new(
            Code::Unimplemented,
            "stack trace, profile id, trace id and span selectors are not answered by stackscope",
        ));
    }
    Ok(())
}

async fn select_merge_profile(
    engine: &QueryEngine,
    request: querier::SelectMergeProfileRequest,
) -> Result<google::Profile, ConnectError> {
    refuse_narrowing(
        request.stack_trace_selector.as_ref(),
        &request.profile_id_selector,
        &request.trace_id_selector,
        &[],
    )?;
    // Checked as Pyroscope checks it, but not applied: a pprof is for a
    // tool that prunes as it reads (`go tool pprof -nodecount`).
    max_nodes(request.max_nodes)?;
    let selection = typed_selection(
        &request.profile_type_id,
        &request.label_selector,
        request.start,
        request.end,
    )?;
    let range = selection.range;
    let profile_type = selection.profile_type.clone();
    let tree = merged_tree(engine, selection).await?;
    // The tree is in the type's unit: CPU time as nanoseconds alone (as
    // Pyroscope answers it), off-CPU time as nanoseconds already.
    let (rendered, period) = match profile_type {
        ProfileType::Cpu => (
            ProfileType::Sent(
                PyroscopeTypeId::new(ProfileType::CPU_ID).expect("the CPU id is an id"),
            ),
            0,
        ),
        ProfileType::OffCpu => (ProfileType::OffCpu, 1),
        sent => (sent, 0),
    };
    let profile = render::pprof_profile(
        &tree,
        &rendered,
        period,
        range.start_unix_nanos,
        range.end_unix_nanos.saturating_sub(range.start_unix_nanos),
    );
    // pprof's message under Pyroscope's package: the same fields.
    google::Profile::decode(&prost::Message::encode_to_vec(&profile)[..])
        .map_err(|err| ConnectError::new(Code::Internal, format!("re-reading a profile: {err}")))
}

async fn select_series(
    engine: &QueryEngine,
    request: querier::SelectSeriesRequest,
) -> Result<querier::SelectSeriesResponse, ConnectError> {
    refuse_narrowing(request.stack_trace_selector.as_ref(), &[], &[], &[])?;
    if request
        .aggregation
        .is_some_and(|a| a != types::TimeSeriesAggregationType::Sum as i32)
    {
        return Err(ConnectError::new(
            Code::Unimplemented,
            "only the sum aggregation is answered (stackscope keeps sums, not profiles)",
        ));
    }
    if !request.step.is_finite() || request.step < 0.001 {
        return Err(ConnectError::invalid(format!(
            "step {} is not a number of seconds of at least 0.001",
            request.step
        )));
    }
    let selection = typed_selection(
        &request.profile_type_id,
        &request.label_selector,
        request.start,
        request.end,
    )?;
    let step_nanos = (request.step * 1e9).min(i64::MAX as f64) as i64;
    // Each group costs storage queries: as many as a grouped flamegraph.
    let groups = combinations(engine, &selection, &request.group_by, MAX_GROUPS).await?;
    let mut series = Vec::with_capacity(groups.len());
    for (narrowed, labels) in groups {
        let (_, points) = engine
            .series_in_units(narrowed, step_nanos)
            .await
            .map_err(query_error)?;
        if points.is_empty() {
            continue;
        }
        series.push(types::Series {
            labels,
            points: points
                .into_iter()
                .map(|(start, weight)| types::Point {
                    value: weight as f64,
                    timestamp: start / 1_000_000,
                    ..Default::default()
                })
                .collect(),
        });
    }
    if let Some(limit) = request.limit.filter(|&l| l > 0) {
        let sum = |s: &types::Series| s.points.iter().map(|p| p.value).sum::<f64>();
        series.sort_by(|a, b| sum(b).total_cmp(&sum(a)));
        series.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    }
    Ok(querier::SelectSeriesResponse { series })
}

async fn profile_stats(
    engine: &QueryEngine,
    _request: types::GetProfileStatsRequest,
) -> Result<types::GetProfileStatsResponse, ConnectError> {
    let selection = Selection {
        range: TimeRange {
            start_unix_nanos: 0,
            end_unix_nanos: i64::MAX,
        },
        matchers: Vec::new(),
        profile_type: ProfileType::Cpu,
    };
    let present = engine.profile_types(selection).await.map_err(query_error)?;
    // Where stored samples begin and end is not kept apart from them:
    // -1 says unknown, as Pyroscope does for a tenant without data.
    Ok(types::GetProfileStatsResponse {
        data_ingested: !present.is_empty(),
        oldest_profile_time: -1,
        newest_profile_time: -1,
    })
}

/// Stores sent profiles as one batch; a refusal as a Connect error.
async fn store_sent(
    state: &SentIngest,
    profiles: Vec<SentProfile>,
) -> Result<IngestOutcome, ConnectError> {
    state
        .store(profiles)
        .await
        .map_err(|refusal| match refusal {
            SentRefusal::Invalid(message) => ConnectError::invalid(message),
            SentRefusal::TooLarge(message) => ConnectError::new(Code::ResourceExhausted, message),
            SentRefusal::Unavailable(message) => ConnectError::new(Code::Unavailable, message),
        })
}

/// `push.v1.PusherService/Push`: each series' raw profiles with its labels.
async fn push(State(state): State<SentIngest>, headers: HeaderMap, body: Bytes) -> Response {
    let (request, encoding) =
        match decode::<PushRequest>(&headers, body, "push.v1.PushRequest", state.max_bytes) {
            Ok(decoded) => decoded,
            Err(err) => return err.into_response(),
        };
    let count: usize = request.series.iter().map(|s| s.samples.len()).sum();
    if count > MAX_PROFILES_PER_REQUEST {
        return ConnectError::invalid(format!(
            "the push holds {count} profiles, more than the {MAX_PROFILES_PER_REQUEST} taken"
        ))
        .into_response();
    }
    let mut profiles = Vec::with_capacity(count);
    for series in request.series {
        let labels: Arc<[(String, String)]> = series
            .labels
            .into_iter()
            .map(|pair| (pair.name, pair.value))
            .collect();
        for sample in series.samples {
            profiles.push(SentProfile {
                labels: Arc::clone(&labels),
                pprof: sample.raw_profile,
                window: None,
            });
        }
    }
    match store_sent(&state, profiles).await {
        Ok(_) => respond(&PushResponse {}, "push.v1.PushResponse", encoding),
        Err(err) => err.into_response(),
    }
}

/// `/ingest`'s query parameters (Pyroscope's legacy ingest API).
#[derive(Debug, Deserialize)]
struct IngestParams {
    /// `app.cpu{key=value,...}`: the application, the profile's kind
    /// (folded bodies), its labels.
    name: String,
    /// Unix seconds.
    from: Option<i64>,
    until: Option<i64>,
    /// `pprof`, `folded` (the default) or `lines`.
    format: Option<String>,
    /// Samples per second of folded CPU stacks (default 100).
    #[serde(rename = "sampleRate")]
    sample_rate: Option<u32>,
}

/// Parses `app.cpu{key=value,...}` into the application's name, the kind
/// after its last dot (if any), and the labels.
fn parse_app_name(text: &str) -> Result<(String, Vec<(String, String)>), String> {
    let (app, labels) = match text.split_once('{') {
        Some((app, rest)) => {
            let inner = rest
                .strip_suffix('}')
                .ok_or_else(|| format!("name {text:?}: the labels do not end with '}}'"))?;
            let labels = inner
                .split(',')
                .filter(|pair| !pair.trim().is_empty())
                .map(|pair| {
                    pair.split_once('=')
                        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                        .ok_or_else(|| format!("name {text:?}: label {pair:?} has no '='"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            (app.trim(), labels)
        }
        None => (text.trim(), Vec::new()),
    };
    if app.is_empty() {
        return Err(format!("name {text:?} names no application"));
    }
    Ok((app.to_owned(), labels))
}

/// What a folded body of one kind (the name's suffix) holds, as pprof
/// would say it.
struct FoldedKind {
    /// The profile's name (Pyroscope's `__name__`).
    name: &'static str,
    sample_type: (&'static str, &'static str),
    period_type: (&'static str, &'static str),
}

fn folded_kind(kind: &str) -> Option<FoldedKind> {
    let (name, sample_type, period_type) = match kind {
        "cpu" | "itimer" | "" => (
            "process_cpu",
            ("cpu", "nanoseconds"),
            ("cpu", "nanoseconds"),
        ),
        "alloc_objects" => ("memory", ("alloc_objects", "count"), ("space", "bytes")),
        "alloc_space" => ("memory", ("alloc_space", "bytes"), ("space", "bytes")),
        "inuse_objects" => ("memory", ("inuse_objects", "count"), ("space", "bytes")),
        "inuse_space" => ("memory", ("inuse_space", "bytes"), ("space", "bytes")),
        _ => return None,
    };
    Some(FoldedKind {
        name,
        sample_type,
        period_type,
    })
}

/// Folded stacks (`a;b;c 12` per line, root first) as a pprof profile of
/// `kind`, so they are stored as pprof bodies are.
fn folded_profile(
    text: &str,
    kind: &str,
    sample_rate: u32,
) -> Result<(String, pprof::Profile), String> {
    let FoldedKind {
        name,
        sample_type,
        period_type,
    } = folded_kind(kind).ok_or_else(|| {
        format!(
            "profiles of kind {kind:?} are not taken in folded form (cpu, alloc_objects, \
             alloc_space, inuse_objects, inuse_space)"
        )
    })?;
    let period = if name == "process_cpu" {
        1_000_000_000 / i64::from(sample_rate.max(1))
    } else {
        1
    };
    let mut strings: Vec<String> = vec![String::new()];
    let mut string_ids: BTreeMap<String, i64> = BTreeMap::new();
    let mut string = |s: &str| -> i64 {
        if let Some(&id) = string_ids.get(s) {
            return id;
        }
        strings.push(s.to_owned());
        string_ids.insert(s.to_owned(), strings.len() as i64 - 1);
        strings.len() as i64 - 1
    };
    let mut functions = Vec::new();
    let mut locations = Vec::new();
    let mut location_of: BTreeMap<String, u64> = BTreeMap::new();
    let mut samples = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let (stack, count) = line
            .rsplit_once(' ')
            .ok_or_else(|| format!("line {}: no count after the stack", number + 1))?;
        let count: i64 = count
            .parse()
            .map_err(|_| format!("line {}: {count:?} is not a count", number + 1))?;
        let mut ids = Vec::new();
        for frame in stack.split(';').filter(|f| !f.is_empty()) {
            let id = match location_of.get(frame) {
                Some(&id) => id,
                None => {
                    let id = locations.len() as u64 + 1;
                    let name = string(frame);
                    functions.push(pprof::Function {
                        id,
                        name,
                        ..Default::default()
                    });
                    locations.push(pprof::Location {
                        id,
                        line: vec![pprof::Line {
                            function_id: id,
                            line: 0,
                        }],
                        ..Default::default()
                    });
                    location_of.insert(frame.to_owned(), id);
                    id
                }
            };
            ids.push(id);
        }
        // pprof stacks are leaf first.
        ids.reverse();
        samples.push(pprof::Sample {
            location_id: ids,
            value: vec![count.saturating_mul(period)],
            label: Vec::new(),
        });
    }
    let sample_type = vec![pprof::ValueType {
        r#type: string(sample_type.0),
        unit: string(sample_type.1),
    }];
    let period_type = Some(pprof::ValueType {
        r#type: string(period_type.0),
        unit: string(period_type.1),
    });
    Ok((
        name.to_owned(),
        pprof::Profile {
            sample_type,
            sample: samples,
            location: locations,
            function: functions,
            string_table: strings,
            period_type,
            period,
            ..Default::default()
        },
    ))
}

fn ingest_error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, format!("{}\n", message.into())).into_response()
}

/// `POST /ingest`: one profile, pprof (raw, gzipped, or the `profile` part
/// of a multipart form) or folded stacks.
async fn ingest(
    State(state): State<SentIngest>,
    Query(params): Query<IngestParams>,
    request: Request,
) -> Response {
    let bad = |message: String| ingest_error(StatusCode::BAD_REQUEST, message);
    let (app, mut labels) = match parse_app_name(&params.name) {
        Ok(parsed) => parsed,
        Err(message) => return bad(message),
    };
    // The kind is the application name's last dotted part when it is one.
    let (app, kind) = match app.rsplit_once('.') {
        Some((base, kind)) if folded_kind(kind).is_some() => (base.to_owned(), kind.to_owned()),
        _ => (app, String::new()),
    };
    labels.push(("service_name".to_owned(), app));
    let window = match (params.from, params.until) {
        (Some(from), Some(until)) => {
            let seconds = |s: i64| s.saturating_mul(1_000_000_000);
            // A profile of less than a second has from == until.
            Some(TimeRange {
                start_unix_nanos: seconds(from),
                end_unix_nanos: seconds(until).max(seconds(from).saturating_add(1)),
            })
        }
        _ => None,
    };
    let is_multipart = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    let headers = request.headers().clone();
    let body = if is_multipart {
        let mut form = match Multipart::from_request(request, &()).await {
            Ok(form) => form,
            Err(err) => return bad(format!("the multipart form: {err}")),
        };
        let mut profile = None;
        loop {
            match form.next_field().await {
                Ok(Some(field)) if field.name() == Some("profile") => match field.bytes().await {
                    Ok(bytes) => profile = Some(bytes),
                    Err(err) => return bad(format!("the form's profile: {err}")),
                },
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(err) => return bad(format!("the multipart form: {err}")),
            }
        }
        match profile {
            Some(profile) => profile,
            None => return bad("the multipart form has no `profile` part".to_owned()),
        }
    } else {
        match axum::body::to_bytes(request.into_body(), state.max_bytes).await {
            Ok(body) => match decompressed(&headers, body, state.max_bytes) {
                Ok(body) => body,
                Err(err) => return ingest_refusal(err),
            },
            Err(err) => {
                return ingest_error(StatusCode::PAYLOAD_TOO_LARGE, format!("the body: {err}"));
            }
        }
    };
    let profile = match params.format.as_deref().unwrap_or("folded") {
        "pprof" => SentProfile {
            labels: labels.into(),
            pprof: body.to_vec(),
            window,
        },
        "folded" | "lines" => {
            let Ok(text) = std::str::from_utf8(&body) else {
                return bad("the folded stacks are not UTF-8".to_owned());
            };
            match folded_profile(text, &kind, params.sample_rate.unwrap_or(100)) {
                Ok((name, profile)) => {
                    labels.push(("__name__".to_owned(), name));
                    SentProfile {
                        labels: labels.into(),
                        pprof: profile.encode_to_vec(),
                        window,
                    }
                }
                Err(message) => return bad(message),
            }
        }
        other => {
            return bad(format!(
                "format {other:?} is not taken: pprof, folded or lines"
            ));
        }
    };
    match store_sent(&state, vec![profile]).await {
        Ok(_) => StatusCode::OK.into_response(),
        Err(err) => ingest_refusal(err),
    }
}

/// A refusal as `/ingest`'s plain HTTP answers it: too large is 413 (not
/// Connect's 429, which clients retry).
fn ingest_refusal(err: ConnectError) -> Response {
    let status = match err.code {
        Code::InvalidArgument | Code::Unimplemented => StatusCode::BAD_REQUEST,
        Code::ResourceExhausted => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    ingest_error(status, err.message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_name_the_profile_type_as_grafana_writes_it() {
        let parsed =
            parse_selector(r#"process_cpu:cpu:nanoseconds:cpu:nanoseconds{service_name="a"}"#)
                .unwrap();
        assert_eq!(parsed.profile_type, Some(ProfileType::Cpu));
        assert_eq!(parsed.matchers.len(), 1);
        let parsed = parse_selector(
            r#"{__profile_type__="memory:alloc_space:bytes:space:bytes",pod=~"x.*"}"#,
        )
        .unwrap();
        let alloc = parsed.profile_type.clone().unwrap();
        assert_eq!(alloc.name(), "memory:alloc_space:bytes:space:bytes");
        assert_eq!(parsed.matchers[0].name, "pod");
        let parsed =
            parse_selector(r#"{__name__="off_cpu:off_cpu:nanoseconds:off_cpu:nanoseconds"}"#)
                .unwrap();
        assert_eq!(parsed.profile_type, Some(ProfileType::OffCpu));
        // A profile's name alone allows the types of that name.
        let memory = parse_selector(r#"{__name__="memory"}"#).unwrap();
        assert!(memory.allows(&alloc));
        assert!(!memory.allows(&ProfileType::Cpu));
        assert!(
            parse_selector(r#"{__name__="process_cpu"}"#)
                .unwrap()
                .allows(&ProfileType::Cpu)
        );
        assert_eq!(parse_selector("{}").unwrap().matchers.len(), 0);
        assert_eq!(parse_selector("").unwrap().profile_type, None);
        assert!(parse_selector(r#"{__other__="x"}"#).is_err());
        assert!(parse_selector("nonsense{}").is_err());
        assert!(
            parse_selector(
                r#"process_cpu:cpu:nanoseconds:cpu:nanoseconds{__profile_type__="off_cpu"}"#
            )
            .is_err(),
            "two types"
        );
        assert!(
            typed_selection(ProfileType::CPU_ID, r#"{__name__="memory"}"#, 0, 1).is_err(),
            "a type and another's name"
        );
    }

    #[test]
    fn ingest_names_carry_the_application_and_its_labels() {
        assert_eq!(
            parse_app_name("nodeapp{region=x,env=test}").unwrap(),
            (
                "nodeapp".to_owned(),
                vec![
                    ("region".to_owned(), "x".to_owned()),
                    ("env".to_owned(), "test".to_owned())
                ]
            )
        );
        assert_eq!(parse_app_name("app.cpu").unwrap().0, "app.cpu");
        assert!(parse_app_name("{a=b}").is_err());
        assert!(parse_app_name("app{a}").is_err());
        assert!(parse_app_name("app{a=b").is_err());
    }

    #[test]
    fn folded_stacks_become_a_pprof_profile() {
        let (name, profile) = folded_profile("main;work;leaf 3\nmain 1\n\n", "cpu", 100).unwrap();
        assert_eq!(name, "process_cpu");
        assert_eq!(profile.period, 10_000_000);
        assert_eq!(profile.sample.len(), 2);
        assert_eq!(profile.sample[0].value, [30_000_000]);
        let leaf = profile.sample[0].location_id[0];
        let function = profile.function.iter().find(|f| f.id == leaf).unwrap();
        assert_eq!(profile.string_table[function.name as usize], "leaf");
        assert!(folded_profile("main x", "cpu", 100).is_err());
        assert!(folded_profile("main", "cpu", 100).is_err());
        assert!(folded_profile("main 1", "goroutines", 100).is_err());
    }
}
