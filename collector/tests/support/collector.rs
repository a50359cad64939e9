//! A collector on free ports of 127.0.0.1 storing in a real SQLite file in
//! a temporary directory (removed with it), for the collector's
//! integration tests; each test file adds the calls it makes.

// Each test target uses its own part of it.
#![allow(dead_code)]

use std::{net::SocketAddr, sync::Arc};

use stackscope_collector::{
    server::{self, RunningCollector, ServerConfig},
    storage::sqlite::{SqliteOptions, SqliteStorage},
};

pub struct Fixture {
    pub collector: RunningCollector,
    _dir: tempfile::TempDir,
}

/// Starts a collector with `config`, its addresses made free ports of
/// 127.0.0.1 (HTTP on).
pub async fn start_with(config: ServerConfig) -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let storage = SqliteStorage::open(&dir.path().join("stackscope.db"), SqliteOptions::default())
        .expect("opening the database");
    let config = ServerConfig {
        grpc_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        http_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ..config
    };
    let collector = server::start(config, Arc::new(storage))
        .await
        .expect("starting the collector");
    Fixture {
        collector,
        _dir: dir,
    }
}
