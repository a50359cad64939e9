//! The ClickHouse schema: which tables exist on every server, created if
//! missing, and the settings the data depends on (`meta`), checked against
//! the collector's. Owns the DDL; the statements that read and write rows
//! live in `mod.rs`.
//!
//! Written for ClickHouse 18.16 (Debian's package) and kept to what current
//! releases accept too: `ENGINE = MergeTree() PARTITION BY .. ORDER BY ..`
//! (not the deprecated `MergeTree(date, key, 8192)`), no `TTL` (19.6+),
//! no `ON CLUSTER` (needs ZooKeeper): each server gets its tables from the
//! collector itself, no `UInt128` (20.x+, `FixedString(16)` holds hashes),
//! no `LowCardinality`, no `Nullable`.

/// Bumped on any change to the tables; a collector refuses a database
/// written by a newer schema and upgrades an older one (see
/// [`upgrade_statements`]).
pub const SCHEMA_VERSION: i64 = 3;

/// Rows per index mark of the rollup tables (8192 by default): a query
/// with matchers reads a few label sets of each span, scattered by their
/// hash through the span's rows, and a granule read holds one.
const ROLLUP_GRANULARITY: usize = 1024;

/// A database's tables, named for the statements that use them.
#[derive(Debug, Clone)]
pub struct Tables {
    pub database: String,
    /// Reads and inserts go through the `Distributed` tables when there is
    /// a cluster, straight to the local ones otherwise.
    pub distributed: bool,
}

impl Tables {
    /// The table statements read from and insert into: `db.samples` (the
    /// `Distributed` table over every shard's `samples_local`) or
    /// `db.samples_local` on a single server.
    pub fn table(&self, name: &str) -> String {
        if self.distributed {
            format!("{}.{name}", self.database)
        } else {
            self.local(name)
        }
    }

    /// A server's own table.
    pub fn local(&self, name: &str) -> String {
        format!("{}.{name}_local", self.database)
    }

    /// A table every server keeps on its own, never distributed.
    pub fn own(&self, name: &str) -> String {
        format!("{}.{name}", self.database)
    }
}

/// The tables and how a `Distributed` table over each spreads rows: by
/// the hash that also names duplicates, so a retried row lands on the
/// shard that holds its first copy and collapses with it. (A batch's
/// `samples`, `attempts` and `batches` rows are written by the collector
/// straight to its home shard, picked by the batch id, so a retry's copies
/// land with the first ones too, unless the home could not be reached
/// once: reads count copies on two shards once, merges never collapse
/// them.)
///
/// * `samples`: one row per (batch, bucket, label set, stack) with the
///   summed weight and the batch's sample period. `ReplacingMergeTree`
///   keyed by all four: an exact duplicate (a retried batch whose first
///   attempt stored rows, by this or another collector) goes at a merge,
///   and counts once before (see `attempts`); a copy under a label set id
///   a former collector gave (see `clustered_label_set_id`) never merges
///   and counts once all the same (`ROW_COPY_KEY`).
/// * `stacks`: stack hash -> self-contained frames blob (`codec`).
/// * `label_sets`: label set id -> sorted names and values. The id is a
///   hash of the labels whose first bytes are its node's (see
///   `clustered_label_set_id`), so the tables ordered by label set keep a
///   node's rows together.
/// * `batches`: ids of stored batches, for dedup of retries.
/// * `attempts`: one row per try at storing a batch's samples, written
///   before them, with the time it began (`at_unix_nanos`, 0 for tries
///   registered before schema version 3). A batch with more than one (a retry after a failure
///   between its samples and its id, two collectors racing, an insert sent
///   again to another server) may have its samples on disk more than
///   once: reads sum plain rows, and only such batches' rows are
///   deduplicated (`FINAL` would merge every row of the range in one
///   stream per shard).
/// * `rollups`, `rollup_sets`, `rollup_spans`: sums of closed spans of
///   time, per label set and stack, per label set, and the marker of each
///   build (see `rollup`).
///
/// Every table is partitioned by time (`intDiv(bucket, partition width)`),
/// dictionaries by a bucket of the samples that use them: retention drops
/// whole partitions (`ALTER TABLE .. DROP PARTITION`), and a dictionary row
/// lives in every partition that has samples referencing it, so dropping a
/// partition never orphans a newer sample.
pub fn local_tables(partition_nanos: i64) -> [(&'static str, String, &'static str); 8] {
    let p = partition_nanos;
    [
        (
            "samples",
            format!(
                "(bucket Int64, label_set FixedString(16), stack FixedString(16), \
                 batch FixedString(16), sample_period UInt64, weight UInt64) \
                 ENGINE = ReplacingMergeTree() PARTITION BY intDiv(bucket, {p}) \
                 ORDER BY (bucket, label_set, stack, batch)"
            ),
            "sipHash64(batch)",
        ),
        (
            "stacks",
            format!(
                "(stack FixedString(16), bucket Int64, frames String) \
                 ENGINE = ReplacingMergeTree() PARTITION BY intDiv(bucket, {p}) ORDER BY stack"
            ),
            "sipHash64(stack)",
        ),
        (
            "label_sets",
            format!(
                "(label_set FixedString(16), bucket Int64, label_names Array(String), \
                 label_values Array(String)) \
                 ENGINE = ReplacingMergeTree() PARTITION BY intDiv(bucket, {p}) \
                 ORDER BY label_set"
            ),
            "sipHash64(label_set)",
        ),
        (
            "batches",
            format!(
                "(batch FixedString(16), received_unix_nanos Int64, end_unix_nanos Int64) \
                 ENGINE = ReplacingMergeTree() \
                 PARTITION BY intDiv(greatest(received_unix_nanos, end_unix_nanos), {p}) \
                 ORDER BY batch"
            ),
            "sipHash64(batch)",
        ),
        (
            "attempts",
            format!(
                "(batch FixedString(16), bucket Int64, at_unix_nanos Int64) \
                 ENGINE = MergeTree() PARTITION BY intDiv(bucket, {p}) ORDER BY (bucket, batch)"
            ),
            "sipHash64(batch)",
        ),
        (
            "rollups",
            format!(
                "(width Int64, span_start Int64, build FixedString(16), \
                 label_set FixedString(16), stack FixedString(16), sample_period UInt64, \
                 weight0 UInt64, weight1 UInt64, weight2 UInt64) \
                 ENGINE = MergeTree() PARTITION BY intDiv(span_start, {p}) \
                 ORDER BY (width, span_start, build, label_set, stack) \
                 SETTINGS index_granularity = {ROLLUP_GRANULARITY}"
            ),
            "sipHash64(label_set, stack)",
        ),
        (
            "rollup_sets",
            format!(
                "(width Int64, span_start Int64, build FixedString(16), \
                 label_set FixedString(16), sample_period UInt64, \
                 weight0 UInt64, weight1 UInt64, weight2 UInt64) \
                 ENGINE = MergeTree() PARTITION BY intDiv(span_start, {p}) \
                 ORDER BY (width, span_start, build, label_set) \
                 SETTINGS index_granularity = {ROLLUP_GRANULARITY}"
            ),
            "sipHash64(label_set)",
        ),
        (
            "rollup_spans",
            format!(
                "(width Int64, span_start Int64, build FixedString(16), tries UInt64, \
                 tries_checksum UInt64, built_unix_nanos Int64) \
                 ENGINE = MergeTree() PARTITION BY intDiv(span_start, {p}) \
                 ORDER BY (width, span_start)"
            ),
            "sipHash64(build)",
        ),
    ]
}

/// What brings one server's tables written by `from` (older than
/// [`SCHEMA_VERSION`]) up to date, after [`create_statements`] made the
/// missing tables (and `attempts` has its `at_unix_nanos`, which version 2
/// did not: see `ClickhouseStorage::upgrade_server`): version 1 had no
/// `attempts` and read sums with `FINAL`,
/// so every batch whose rows are still on disk more than once (a retry
/// not yet merged away) is registered as tried twice, one statement per
/// partition of `partitions` (of width `partition_nanos`).
pub fn upgrade_statements(
    tables: &Tables,
    from: i64,
    partitions: &[i64],
    partition_nanos: i64,
) -> Vec<String> {
    if from >= 2 {
        return Vec::new();
    }
    partitions
        .iter()
        .map(|partition| {
            format!(
                "INSERT INTO {attempts} (batch, bucket, at_unix_nanos) \
                 SELECT batch, bucket, 0 FROM (SELECT DISTINCT batch, bucket FROM {samples} \
                 WHERE intDiv(bucket, {partition_nanos}) = {partition} \
                 GROUP BY bucket, label_set, stack, batch HAVING count() > 1) \
                 ARRAY JOIN [1, 2] AS copy",
                attempts = tables.local("attempts"),
                samples = tables.local("samples"),
            )
        })
        .collect()
}

/// How many of [`create_statements`] come first and make the database
/// and `meta`, whose settings are checked before the rest are made.
pub const SETTINGS_STATEMENTS: usize = 2;

/// The statements that create everything on one server, in order.
pub fn create_statements(
    tables: &Tables,
    cluster: Option<&str>,
    partition_nanos: i64,
) -> Vec<String> {
    let db = &tables.database;
    let mut statements = vec![
        format!("CREATE DATABASE IF NOT EXISTS {db}"),
        // Settings the stored data depends on, the same on every server.
        format!(
            "CREATE TABLE IF NOT EXISTS {} (key String, value Int64) \
             ENGINE = ReplacingMergeTree() ORDER BY key",
            tables.own("meta")
        ),
        // Retention's high-water mark: buckets at or before the largest
        // `last_bucket` are deleted, whether or not their partition has
        // been dropped yet. Written to every server, read by the one a
        // query runs on.
        format!(
            "CREATE TABLE IF NOT EXISTS {} (last_bucket Int64, at_unix_nanos Int64) \
             ENGINE = MergeTree() ORDER BY last_bucket",
            tables.own("retention")
        ),
    ];
    for (name, columns, sharding_key) in local_tables(partition_nanos) {
        statements.push(format!(
            "CREATE TABLE IF NOT EXISTS {} {columns}",
            tables.local(name)
        ));
        if let Some(cluster) = cluster {
            statements.push(format!(
                "CREATE TABLE IF NOT EXISTS {} AS {} \
                 ENGINE = Distributed('{cluster}', '{db}', '{name}_local', {sharding_key})",
                tables.table(name),
                tables.local(name)
            ));
        }
    }
    statements
}

/// Whether `name` can be a database or cluster name in the statements
/// above without quoting: ASCII letters, digits and `_`, not starting with
/// a digit (clusters may also hold `-` and `.`, inside quotes).
pub fn is_plain_identifier(name: &str, extra: &[u8]) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || extra.contains(&b))
        && name.len() <= 128
}

/// Partitions (as `system.parts` names their values) whose every bucket is
/// at or before `last`: what retention may drop whole. A partition value
/// `p` of `intDiv(x, width)` covers `[p * width, (p + 1) * width)` for
/// `p > 0`, `(-width, width)` for 0 (intDiv rounds toward zero) and
/// `((p - 1) * width, p * width]` for `p < 0`.
pub fn partition_is_before(partition: i64, width: i64, last: i64) -> bool {
    let (p, width) = (i128::from(partition), i128::from(width));
    let newest = if p >= 0 {
        (p + 1) * width - 1
    } else {
        p * width
    };
    newest <= i128::from(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_before_a_bucket() {
        // Width 10: partition 1 holds 10..=19, 0 holds -9..=9, -1 holds -19..=-10.
        assert!(partition_is_before(1, 10, 19));
        assert!(!partition_is_before(1, 10, 18));
        assert!(partition_is_before(0, 10, 9));
        assert!(!partition_is_before(0, 10, 8));
        assert!(partition_is_before(-1, 10, -10));
        assert!(!partition_is_before(-1, 10, -11));
        assert!(!partition_is_before(i64::MAX, i64::MAX, i64::MAX));
    }

    #[test]
    fn identifiers() {
        assert!(is_plain_identifier("stackscope_1", &[]));
        assert!(!is_plain_identifier("1db", &[]));
        assert!(!is_plain_identifier("db; DROP", &[]));
        assert!(!is_plain_identifier("", &[]));
        assert!(is_plain_identifier("my-cluster.a", b"-."));
        assert!(!is_plain_identifier("my'cluster", b"-."));
    }
}
