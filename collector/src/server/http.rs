//! The HTTP API: the same queries as the gRPC `Query` service, rendered for
//! browsers and scripts (SVG, JSON, folded stacks, pprof), and the web UI
//! (`collector/ui/`: plain HTML, CSS and JavaScript modules compiled into the
//! binary, no build step) that is a client of that API.
//!
//! Every endpoint takes the selection as query parameters: `match`
//! (`comm="x",exe=~".*/y"`), and `since` (default 1h) or `start`/`end`.
//! `/api/v1/flamegraph` also takes `group_by` (a label name) to split the
//! tree by that label's values (see [`QueryEngine::flamegraph`]).

use std::collections::HashMap;

use axum::{
    Json, Router,
    extract::{Path, Query, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use serde::{Deserialize, Serialize};
use stackscope_profile::{
    model::{Frame, ProfileType, Selection},
    render::{self, SvgOptions},
    timespec::{self, SelectionText},
};

use crate::query::{DEFAULT_TOP_LIMIT, Fault, Flamegraph, QueryEngine, QueryError};

/// The query API (behind the query token when there is one).
pub fn router(engine: QueryEngine) -> Router {
    Router::new()
        .route("/flamegraph.svg", get(index))
        .route("/api/v1/flamegraph", get(flamegraph))
        .route("/api/v1/diff", get(diff))
        .route("/api/v1/top", get(top))
        .route("/api/v1/callers", get(callers))
        .route("/api/v1/labels", get(label_names))
        .route("/api/v1/labels/{name}/values", get(label_values))
        .route("/api/v1/series", get(series))
        .route("/api/v1/types", get(profile_types))
        .with_state(engine)
}

/// The web UI's files: path, content type, contents. They hold no data (the
/// page asks the API, with the token the user gives it), so they are served
/// without the query token: a browser can load the page and then ask for it.
const UI_FILES: &[(&str, &str, &str)] = &[
    ("/", HTML, include_str!("../../ui/index.html")),
    ("/ui/style.css", CSS, include_str!("../../ui/style.css")),
    ("/ui/app.js", JS, include_str!("../../ui/app.js")),
    ("/ui/api.js", JS, include_str!("../../ui/api.js")),
    (
        "/ui/flamegraph.js",
        JS,
        include_str!("../../ui/flamegraph.js"),
    ),
    ("/ui/timeline.js", JS, include_str!("../../ui/timeline.js")),
    ("/ui/query.js", JS, include_str!("../../ui/query.js")),
];
const HTML: &str = "text/html; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";

/// The page may load its own files and ask its own API, nothing else: no
/// CDN, no inline script, so it works offline and an injected name cannot
/// run as code.
const UI_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                      connect-src 'self'; img-src 'self' data: blob:; base-uri 'none'; \
                      form-action 'none'; frame-ancestors 'none'";

/// The web UI's routes.
pub fn ui_router() -> Router {
    UI_FILES
        .iter()
        .fold(Router::new(), |router, &(path, content_type, body)| {
            let etag = etag(body);
            router.route(
                path,
                get(move |headers: HeaderMap| {
                    let response = ui_file(&headers, content_type, body, &etag);
                    async move { response }
                }),
            )
        })
}

/// A UI file, revalidated on every load (`no-cache` with an `ETag`): a new
/// collector serves its own UI at once, and an unchanged file costs a 304.
fn ui_file(
    request: &HeaderMap,
    content_type: &'static str,
    body: &'static str,
    etag: &str,
) -> Response {
    let etag_value = HeaderValue::from_str(etag).expect("hex in quotes is a header value");
    let common = [
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        (header::ETAG, etag_value),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(UI_CSP),
        ),
    ];
    let fresh = request
        .get(header::IF_NONE_MATCH)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|given| given.split(',').any(|tag| tag.trim() == etag));
    if fresh {
        return (StatusCode::NOT_MODIFIED, common).into_response();
    }
    (
        common,
        [(header::CONTENT_TYPE, HeaderValue::from_static(content_type))],
        body,
    )
        .into_response()
}

/// An `ETag` that changes when the file does.
fn etag(body: &str) -> String {
    format!("\"{:016x}\"", xxhash_rust::xxh3::xxh3_64(body.as_bytes()))
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
    /// The profile type (`cpu`, `off_cpu`); CPU when absent.
    #[serde(rename = "type")]
    profile_type: Option<String>,
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
            profile_type: self.profile_type.as_deref(),
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
            ..SelectionText::default()
        };
        self.text().baseline(base).parse().map_err(bad_request)
    }

    fn format(&self) -> Result<Format, ApiError> {
        match self.format.as_deref() {
            None | Some("svg") => Ok(Format::Svg),
            Some("json") => Ok(Format::Json),
            Some("folded") => Ok(Format::Folded),
            Some("pprof") => Ok(Format::Pprof),
            Some("flat") => Ok(Format::Flat),
            Some(other) => Err(bad_request(format!(
                "format {other:?}: expected svg, json, flat, folded or pprof"
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
    /// [`FlatTree`]: what the web UI draws.
    Flat,
}

/// The tree as flat arrays, compact enough for a fleet-wide tree of
/// hundreds of thousands of nodes (the nested `json` format repeats every
/// field name and frame per node): each distinct frame once in `frames`, and
/// `nodes` as `[parent, frame, total]` triples in the tree's depth-first
/// order, parents before children, the root first and its own parent. Self
/// weights are each node's total minus its children's.
#[derive(Serialize)]
struct FlatTree<'a> {
    /// The profile type the weights are of (`cpu`, `off_cpu`, a sent
    /// type's id).
    profile_type: &'a str,
    total: u64,
    sample_period_nanos: u64,
    frames: Vec<FlatFrame<'a>>,
    nodes: Vec<u64>,
}

#[derive(Serialize)]
struct FlatFrame<'a> {
    name: &'a str,
    binary: &'a str,
    file: &'a str,
    line: u32,
    inlined: bool,
}

fn flat<'a>(flamegraph: &'a Flamegraph, profile_type: &'a ProfileType) -> FlatTree<'a> {
    let tree = &flamegraph.tree;
    let mut numbers: HashMap<&Frame, u64> = HashMap::new();
    let mut frames = Vec::new();
    let mut nodes = Vec::with_capacity(tree.nodes().len() * 3);
    for node in tree.nodes() {
        let frame = node.frame();
        let number = *numbers.entry(frame).or_insert_with(|| {
            frames.push(FlatFrame {
                name: &frame.function,
                binary: &frame.binary,
                file: &frame.file,
                line: frame.line,
                inlined: frame.inlined,
            });
            frames.len() as u64 - 1
        });
        nodes.extend([node.parent().unwrap_or(0) as u64, number, node.total()]);
    }
    FlatTree {
        profile_type: profile_type.name(),
        total: tree.total(),
        sample_period_nanos: flamegraph.sample_period_nanos,
        frames,
        nodes,
    }
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
            let options = SvgOptions::titled(title, &selection.profile_type);
            match render::svg(&flamegraph.tree, &options) {
                Ok(bytes) => svg_response(bytes),
                Err(err) => ApiError(StatusCode::NOT_FOUND, format!("{err}")).into_response(),
            }
        }
        Format::Json => Json(render::json(&flamegraph.tree)).into_response(),
        Format::Flat => Json(flat(flamegraph, &selection.profile_type)).into_response(),
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
                &selection.profile_type,
                flamegraph.sample_period_nanos,
                selection.range.start_unix_nanos,
                selection.range.end_unix_nanos - selection.range.start_unix_nanos,
            ),
        )
            .into_response(),
    })
}

/// `/flamegraph.svg`: the last 15 minutes of everything as one SVG, for a
/// link or `curl` (the page at `/` is the web UI).
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
        "stackscope: the last 15 minutes (see / for the web UI, /api/v1/flamegraph for queries)"
            .into(),
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
    let options = SvgOptions::titled(
        timespec::diff_title(&selection, &base),
        &selection.profile_type,
    );
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

/// The profile types with samples in the selection, CPU first.
async fn profile_types(
    State(engine): State<QueryEngine>,
    Query(params): Query<Params>,
) -> Result<Json<Vec<String>>, ApiError> {
    let types = engine.profile_types(params.selection()?).await?;
    Ok(Json(types.iter().map(|t| t.name().to_owned()).collect()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ui_files_are_revalidated_by_etag() {
        let (path, content_type, body) = UI_FILES[0];
        assert_eq!(path, "/");
        let etag = etag(body);
        let first = ui_file(&HeaderMap::new(), content_type, body, &etag);
        assert_eq!(first.status(), StatusCode::OK);
        assert_eq!(first.headers()[header::CONTENT_TYPE], HTML);
        assert_eq!(first.headers()[header::CACHE_CONTROL], "no-cache");
        assert_eq!(first.headers()[header::ETAG], etag.as_str());

        let mut again = HeaderMap::new();
        again.insert(
            header::IF_NONE_MATCH,
            format!("\"other\", {etag}").parse().unwrap(),
        );
        let second = ui_file(&again, content_type, body, &etag);
        assert_eq!(second.status(), StatusCode::NOT_MODIFIED);
        assert_eq!(second.headers()[header::ETAG], etag.as_str());

        again.insert(header::IF_NONE_MATCH, "\"stale\"".parse().unwrap());
        assert_eq!(
            ui_file(&again, content_type, body, &etag).status(),
            StatusCode::OK
        );
    }

    #[test]
    fn every_ui_module_the_page_imports_is_served() {
        let served: Vec<&str> = UI_FILES.iter().map(|&(path, _, _)| path).collect();
        for &(_, _, body) in UI_FILES {
            for import in body
                .split("from \"./")
                .skip(1)
                .filter_map(|rest| rest.split('"').next())
            {
                let path = format!("/ui/{import}");
                assert!(served.contains(&path.as_str()), "{path} is not served");
            }
        }
        // And every file the page links to or loads.
        let page = UI_FILES[0].2;
        let linked: Vec<&str> = ["href=\"", "src=\""]
            .iter()
            .flat_map(|attribute| page.split(attribute).skip(1))
            .filter_map(|rest| rest.split('"').next())
            .filter(|link| link.starts_with("/ui/"))
            .collect();
        assert!(
            linked.len() >= 2,
            "the page links its style and script: {linked:?}"
        );
        for link in linked {
            assert!(served.contains(&link), "{link} is not served");
        }
    }
}
