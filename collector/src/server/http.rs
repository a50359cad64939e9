//! The HTTP API: the same queries as the gRPC `Query` service, rendered for
//! browsers and scripts (SVG, JSON, folded stacks, pprof).
//!
//! Every endpoint takes the selection as query parameters: `match`
//! (`comm="x",exe=~".*/y"`), and `since` (default 1h) or `start`/`end`.
//! `/api/v1/flamegraph` also takes `group_by` (a label name) to split the
//! tree by that label's values (see [`QueryEngine::flamegraph`]).

use axum::{
    Json, Router,
    extract::{Path, Query, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use serde::Deserialize;
use stackscope_profile::{
    model::Selection,
    render::{self, SvgOptions},
    timespec::{self, SelectionText},
};

use crate::query::{DEFAULT_TOP_LIMIT, Fault, Flamegraph, QueryEngine, QueryError};

pub fn router(engine: QueryEngine) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/api/v1/flamegraph", get(flamegraph))
        .route("/api/v1/diff", get(diff))
        .route("/api/v1/top", get(top))
        .route("/api/v1/callers", get(callers))
        .route("/api/v1/labels", get(label_names))
        .route("/api/v1/labels/{name}/values", get(label_values))
        .route("/api/v1/series", get(series))
        .with_state(engine)
}

/// An error the client can act on, or a server failure.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, format!("{}\n", self.1)).into_response()
    }
}

fn bad_request(err: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, err.to_string())
}

impl From<QueryError> for ApiError {
    fn from(err: QueryError) -> Self {
        match err.into_public() {
            (Fault::Request, message) => ApiError(StatusCode::BAD_REQUEST, message),
            (Fault::Collector, message) => ApiError(StatusCode::INTERNAL_SERVER_ERROR, message),
        }
    }
}

/// Every query parameter any endpoint reads, as text: `serde_urlencoded`
/// cannot parse numbers inside flattened structs, and parsing here gives
/// errors that name the parameter.
#[derive(Debug, Deserialize, Default)]
struct Params {
    #[serde(rename = "match")]
    matchers: Option<String>,
    since: Option<String>,
    start: Option<String>,
    end: Option<String>,
    format: Option<String>,
    min_share: Option<String>,
    title: Option<String>,
    limit: Option<String>,
    step: Option<String>,
    function: Option<String>,
    group_by: Option<String>,
    base_match: Option<String>,
    base_since: Option<String>,
    base_start: Option<String>,
    base_end: Option<String>,
}

impl Params {
    fn text(&self) -> SelectionText<'_> {
        SelectionText {
            matchers: self.matchers.as_deref(),
            since: self.since.as_deref(),
            start: self.start.as_deref(),
            end: self.end.as_deref(),
        }
    }

    fn selection(&self) -> Result<Selection, ApiError> {
        self.text().parse().map_err(bad_request)
    }

    /// The baseline of a diff (`base_*` parameters).
    fn base_selection(&self) -> Result<Selection, ApiError> {
        let base = SelectionText {
            matchers: self.base_match.as_deref(),
            since: self.base_since.as_deref(),
            start: self.base_start.as_deref(),
            end: self.base_end.as_deref(),
        };
        self.text().baseline(base).parse().map_err(bad_request)
    }

    fn format(&self) -> Result<Format, ApiError> {
        match self.format.as_deref() {
            None | Some("svg") => Ok(Format::Svg),
            Some("json") => Ok(Format::Json),
            Some("folded") => Ok(Format::Folded),
            Some("pprof") => Ok(Format::Pprof),
            Some(other) => Err(bad_request(format!(
                "format {other:?}: expected svg, json, folded or pprof"
            ))),
        }
    }

    /// The engine checks the range.
    fn min_share(&self) -> Result<f64, ApiError> {
        let Some(text) = &self.min_share else {
            return Ok(0.0);
        };
        text.parse::<f64>().map_err(|_| {
            bad_request(format!(
                "min_share {text:?}: expected a share between 0 and 1 (0.05 = 5%)"
            ))
        })
    }

    fn limit(&self) -> Result<usize, ApiError> {
        match &self.limit {
            None => Ok(DEFAULT_TOP_LIMIT),
            Some(text) => text
                .parse()
                .map_err(|_| bad_request(format!("limit {text:?}: expected a count"))),
        }
    }

    fn step_nanos(&self) -> Result<i64, ApiError> {
        match &self.step {
            None => Ok(0),
            Some(text) => humantime::parse_duration(text)
                .map(|step| i64::try_from(step.as_nanos()).unwrap_or(i64::MAX))
                .map_err(|_| bad_request(format!("step {text:?}: expected a duration like 10s"))),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Svg,
    Json,
    Folded,
    Pprof,
}

fn svg_response(bytes: Vec<u8>) -> Response {
    ([(header::CONTENT_TYPE, "image/svg+xml")], bytes).into_response()
}

fn render(
    flamegraph: &Flamegraph,
    format: Format,
    title: String,
    selection: &Selection,
) -> Result<Response, ApiError> {
    Ok(match format {
        Format::Svg => {
            let options = SvgOptions {
                title,
                ..SvgOptions::default()
            };
            match render::svg(&flamegraph.tree, &options) {
                Ok(bytes) => svg_response(bytes),
                Err(err) => ApiError(StatusCode::NOT_FOUND, format!("{err}")).into_response(),
            }
        }
        Format::Json => Json(render::json(&flamegraph.tree)).into_response(),
        Format::Folded => (
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            render::folded(&flamegraph.tree),
        )
            .into_response(),
        Format::Pprof => (
            [
                (header::CONTENT_TYPE, "application/octet-stream"),
                (
                    header::CONTENT_DISPOSITION,
                    "attachment; filename=\"profile.pb.gz\"",
                ),
            ],
            render::pprof(
                &flamegraph.tree,
                flamegraph.sample_period_nanos,
                selection.range.start_unix_nanos,
                selection.range.end_unix_nanos - selection.range.start_unix_nanos,
            ),
        )
            .into_response(),
    })
}

async fn index(State(engine): State<QueryEngine>) -> Result<Response, ApiError> {
    let selection = SelectionText {
        since: Some("15m"),
        ..SelectionText::default()
    }
    .parse()
    .map_err(bad_request)?;
    let flamegraph = engine.flamegraph(selection.clone(), 0.0, None).await?;
    render(
        &flamegraph,
        Format::Svg,
        "stackscope: the last 15 minutes (see /api/v1/flamegraph for queries)".into(),
        &selection,
    )
}

async fn flamegraph(
    State(engine): State<QueryEngine>,
    Query(params): Query<Params>,
) -> Result<Response, ApiError> {
    let selection = params.selection()?;
    let (format, min_share) = (params.format()?, params.min_share()?);
    let flamegraph = engine
        .flamegraph(selection.clone(), min_share, params.group_by.as_deref())
        .await?;
    let title = params
        .title
        .clone()
        .unwrap_or_else(|| timespec::title(&selection));
    render(&flamegraph, format, title, &selection)
}

/// A differential flamegraph: the selection against a baseline selection
/// (`base_*` parameters).
async fn diff(
    State(engine): State<QueryEngine>,
    Query(params): Query<Params>,
) -> Result<Response, ApiError> {
    let (selection, base) = (params.selection()?, params.base_selection()?);
    let (new, old) = tokio::try_join!(
        engine.flamegraph(selection.clone(), 0.0, None),
        engine.flamegraph(base.clone(), 0.0, None)
    )?;
    let options = SvgOptions {
        title: timespec::diff_title(&selection, &base),
        ..SvgOptions::default()
    };
    match render::diff_svg(&old.tree, &new.tree, &options) {
        Ok(bytes) => Ok(svg_response(bytes)),
        Err(err) => Err(ApiError(StatusCode::NOT_FOUND, err.to_string())),
    }
}

async fn top(
    State(engine): State<QueryEngine>,
    Query(params): Query<Params>,
) -> Result<Response, ApiError> {
    let (selection, limit) = (params.selection()?, params.limit()?);
    let flamegraph = engine.flamegraph(selection, 0.0, None).await?;
    let functions = render::top_functions(&flamegraph.tree, limit);
    Ok(Json(serde_json::json!({
        "total": flamegraph.tree.total(),
        "functions": functions.iter().map(|f| serde_json::json!({
            "function": f.function,
            "binary": f.binary,
            "self": f.self_weight,
            "total": f.total_weight,
        })).collect::<Vec<_>>(),
    }))
    .into_response())
}

/// Who calls `function` and what it calls, with their weights.
async fn callers(
    State(engine): State<QueryEngine>,
    Query(params): Query<Params>,
) -> Result<Response, ApiError> {
    let Some(function) = params.function.as_deref().filter(|f| !f.is_empty()) else {
        return Err(bad_request(
            "function: missing (the function name as the flamegraph shows it)",
        ));
    };
    let flamegraph = engine.flamegraph(params.selection()?, 0.0, None).await?;
    let report = render::callers_callees(&flamegraph.tree, function);
    let weighted = |list: &[(String, u64)]| -> Vec<serde_json::Value> {
        list.iter()
            .map(|(name, weight)| serde_json::json!({"function": name, "weight": weight}))
            .collect()
    };
    Ok(Json(serde_json::json!({
        "function": report.function,
        "self": report.self_weight,
        "total": report.total,
        "callers": weighted(&report.callers),
        "callees": weighted(&report.callees),
    }))
    .into_response())
}

async fn label_names(
    State(engine): State<QueryEngine>,
    Query(params): Query<Params>,
) -> Result<Json<Vec<String>>, ApiError> {
    Ok(Json(engine.label_names(params.selection()?).await?))
}

async fn label_values(
    State(engine): State<QueryEngine>,
    Path(name): Path<String>,
    Query(params): Query<Params>,
) -> Result<Json<Vec<String>>, ApiError> {
    Ok(Json(engine.label_values(params.selection()?, name).await?))
}

async fn series(
    State(engine): State<QueryEngine>,
    Query(params): Query<Params>,
) -> Result<Response, ApiError> {
    let (selection, step) = (params.selection()?, params.step_nanos()?);
    let (step, points) = engine.series(selection, step).await?;
    Ok(Json(serde_json::json!({
        "step_nanos": step,
        "points": points.iter().map(|(start, weight)| serde_json::json!({
            "start_unix_nanos": start, "weight": weight,
        })).collect::<Vec<_>>(),
    }))
    .into_response())
}
