//! Bearer tokens: the ingest token agents send with their pushes and
//! uploads, and the query token readers send with their queries, checked
//! on gRPC (an interceptor) and on the HTTP API (a middleware that also
//! takes the token as the password of HTTP Basic authentication, so a
//! browser can ask for it). Health probes and metrics stay open.

use std::sync::Arc;

use base64::{Engine as _, engine::general_purpose::STANDARD as BASE64};

use axum::{
    extract::{Request, State},
    http::{HeaderMap, StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};
use tonic::metadata::{Ascii, MetadataValue};

use super::ServerError;

/// A token requests must carry; `None` lets every request through.
#[derive(Clone)]
pub struct Token {
    /// `Bearer <token>`, as the header carries it.
    bearer: Option<Arc<str>>,
    /// What the error names (`ingest`, `queries`).
    what: &'static str,
}

impl Token {
    pub fn new(token: Option<&str>, what: &'static str) -> Result<Self, ServerError> {
        let bearer = token.map(|token| format!("Bearer {token}"));
        if let Some(bearer) = &bearer {
            MetadataValue::<Ascii>::try_from(bearer.as_str()).map_err(|_| ServerError::Token)?;
        }
        Ok(Self {
            bearer: bearer.map(Arc::from),
            what,
        })
    }

    /// The gRPC check, for `InterceptedService`.
    pub fn interceptor(
        &self,
    ) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone + use<>
    {
        let token = self.clone();
        move |request: tonic::Request<()>| {
            let given = request
                .metadata()
                .get("authorization")
                .and_then(|value| value.to_str().ok());
            if token.accepts(given) {
                Ok(request)
            } else {
                Err(tonic::Status::unauthenticated(format!(
                    "missing or wrong bearer token for {}",
                    token.what
                )))
            }
        }
    }

    fn accepts(&self, authorization: Option<&str>) -> bool {
        match &self.bearer {
            None => true,
            Some(bearer) => authorization.is_some_and(|given| constant_time_eq(given, bearer)),
        }
    }

    /// Bearer, or Basic with the token as the password (any user name).
    fn accepts_http(&self, headers: &HeaderMap) -> bool {
        let Some(bearer) = &self.bearer else {
            return true;
        };
        let Some(given) = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
        else {
            return false;
        };
        if constant_time_eq(given, bearer) {
            return true;
        }
        let token = &bearer["Bearer ".len()..];
        given
            .strip_prefix("Basic ")
            .and_then(|encoded| BASE64.decode(encoded.trim()).ok())
            .and_then(|decoded| String::from_utf8(decoded).ok())
            .and_then(|pair| {
                pair.split_once(':')
                    .map(|(_, password)| constant_time_eq(password, token))
            })
            .unwrap_or(false)
    }
}

/// The HTTP check, for `axum::middleware::from_fn_with_state`.
///
/// The refusal challenges for HTTP Basic, so a browser opening an API URL
/// asks for the token, except for scripts that say so with
/// `X-Requested-With` (the web UI): a challenge would make the browser put
/// up its own password dialog, and hold the script's request until it is
/// answered, instead of letting the page ask for the token itself.
pub async fn require_http(State(token): State<Token>, request: Request, next: Next) -> Response {
    if token.accepts_http(request.headers()) {
        return next.run(request).await;
    }
    let message = format!(
        "missing or wrong token for {}: send `Authorization: Bearer <token>`\n",
        token.what
    );
    if request.headers().contains_key("x-requested-with") {
        return (StatusCode::UNAUTHORIZED, message).into_response();
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Basic realm=\"stackscope\"")],
        message,
    )
        .into_response()
}

/// Compares without stopping at the first difference, so the time taken
/// does not tell how much of a guess was right.
fn constant_time_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |diff, (x, y)| diff | (x ^ y))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_takes_bearer_or_basic_with_the_token_as_password() {
        let token = Token::new(Some("s3cret"), "queries").unwrap();
        let headers = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().unwrap());
            headers
        };
        assert!(token.accepts_http(&headers("Bearer s3cret")));
        assert!(token.accepts_http(&headers("Basic cmVhZGVyOnMzY3JldA==")));
        assert!(!token.accepts_http(&headers("Bearer s3cre")));
        assert!(!token.accepts_http(&headers("Basic dTp0b2s=")));
        assert!(!token.accepts_http(&HeaderMap::new()));
        let open = Token::new(None, "queries").unwrap();
        assert!(open.accepts_http(&HeaderMap::new()));
    }
}
