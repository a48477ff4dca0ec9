//! Results: percentile summaries, the JSON summary, HdrHistogram percentile-distribution
//! (`.hgrm`) files and the terminal table. All latencies are reported in microseconds.

use std::fmt::Write as _;
use std::io;
use std::path::Path;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Percentiles of one histogram, in microseconds.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct Pcts {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub p9999_us: f64,
    pub max_us: f64,
}

impl Pcts {
    /// The percentiles of `h` (values in ns).
    pub fn of(h: &Histogram<u64>) -> Pcts {
        let us = |v: u64| v as f64 / 1000.0;
        if h.is_empty() {
            return Pcts::default();
        }
        Pcts {
            count: h.len(),
            mean_us: h.mean() / 1000.0,
            p50_us: us(h.value_at_quantile(0.50)),
            p90_us: us(h.value_at_quantile(0.90)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            p9999_us: us(h.value_at_quantile(0.9999)),
            max_us: us(h.max()),
        }
    }
}

/// `(percentile 0..100, value µs)` points of the "latency by percentile" curve.
pub fn curve(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    if h.is_empty() {
        return Vec::new();
    }
    let mut pts: Vec<(f64, f64)> = h
        .iter_quantiles(5)
        .map(|v| {
            (
                v.quantile_iterated_to() * 100.0,
                h.highest_equivalent(v.value_iterated_to()) as f64 / 1000.0,
            )
        })
        .collect();
    pts.dedup_by(|a, b| a.0 == b.0);
    pts
}

/// Writes `h` as an HdrHistogram percentile distribution (values in µs), the format
/// of `outputPercentileDistribution` that HdrHistogram's plotter reads.
pub fn write_hgrm(h: &Histogram<u64>, path: &Path) -> io::Result<()> {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>12} {:>14} {:>10} {:>14}\n",
        "Value", "Percentile", "TotalCount", "1/(1-Percentile)"
    );
    if !h.is_empty() {
        for v in h.iter_quantiles(5) {
            let q = v.quantile_iterated_to();
            let inv = if q < 1.0 {
                format!("{:>14.2}", 1.0 / (1.0 - q))
            } else {
                format!("{:>14}", "inf")
            };
            let _ = writeln!(
                s,
                "{:>12.3} {:>2.12} {:>10} {}",
                h.highest_equivalent(v.value_iterated_to()) as f64 / 1000.0,
                q,
                v.count_since_last_iteration(),
                inv
            );
        }
    }
    let _ = writeln!(
        s,
        "#[Mean    = {:>12.3}, StdDeviation   = {:>12.3}]",
        h.mean() / 1000.0,
        h.stdev() / 1000.0
    );
    let _ = writeln!(
        s,
        "#[Max     = {:>12.3}, Total count    = {:>12}]",
        h.max() as f64 / 1000.0,
        h.len()
    );
    let _ = writeln!(
        s,
        "#[Buckets = {:>12}, SubBuckets     = {:>12}]",
        h.buckets(),
        h.distinct_values()
    );
    std::fs::write(path, s)
}

/// Figures of one traffic class.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct ClassSummary {
    pub class: String,
    pub rate_per_s: f64,
    pub sent: u64,
    pub expected_recvs: u64,
    pub delivered_recvs: u64,
    pub missing_recvs: u64,
    pub extra_recvs: u64,
    pub delivered_per_s: f64,
    pub sendack: Pcts,
    pub recv: Pcts,
}

/// One stage histogram of the node (`imrouter_<name>_seconds` in `/metrics`, in the
/// order `/metrics` lists them): the bucket upper bounds holding p50/p90/p99, in µs.
/// A quantile past the last finite bound is infinite (`null` in the JSON).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct StageSummary {
    pub name: String,
    pub count: u64,
    pub mean_us: f64,
    #[serde(deserialize_with = "inf_if_null")]
    pub p50_le_us: f64,
    #[serde(deserialize_with = "inf_if_null")]
    pub p90_le_us: f64,
    #[serde(deserialize_with = "inf_if_null")]
    pub p99_le_us: f64,
    /// The histogram's largest finite bucket bound.
    #[serde(default)]
    pub last_bound_us: f64,
}

/// JSON has no infinity: serde_json writes it as `null`, read back here.
fn inf_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let v: Option<f64> = serde::Deserialize::deserialize(d)?;
    Ok(v.unwrap_or(f64::INFINITY))
}

/// A duration in µs with 3 significant digits below 100 µs (`0.25`, `4.07`, `12.5`),
/// whole µs above.
pub fn fmt_us(v: f64) -> String {
    if !v.is_finite() || v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{}", crate::target::round_significant(v, 3))
    }
}

/// `p50 ≤ 0.5 µs`, or `p99 > 5000 µs` past the last finite bucket bound.
fn fmt_bound(label: &str, le_us: f64, last_us: f64) -> String {
    if le_us.is_finite() {
        format!("{label} ≤ {le_us} µs")
    } else {
        format!("{label} > {last_us} µs")
    }
}

impl StageSummary {
    /// The terminal line (`node stage <name>: …`; the `stage_` prefix of the metric
    /// name is left out).
    pub fn line(&self) -> String {
        format!(
            "node stage {}: {} observations, mean {} µs, {}, {}, {} (bucket bounds)",
            self.name.strip_prefix("stage_").unwrap_or(&self.name),
            self.count,
            fmt_us(self.mean_us),
            fmt_bound("p50", self.p50_le_us, self.last_bound_us),
            fmt_bound("p90", self.p90_le_us, self.last_bound_us),
            fmt_bound("p99", self.p99_le_us, self.last_bound_us),
        )
    }
}

/// The node's stage histograms over a run, from its `/metrics` text before and after:
/// every `imrouter_*_seconds` histogram with observations in between, in the order
/// `/metrics` lists them.
pub fn node_stages(before: &str, after: &str) -> Vec<StageSummary> {
    let before = crate::target::PromHist::parse_all(before);
    crate::target::PromHist::parse_all(after)
        .into_iter()
        .map(|h| h.minus(before.iter().find(|b| b.name == h.name)))
        .filter(|d| d.count > 0)
        .map(|d| StageSummary {
            count: d.count,
            mean_us: d.sum_s * 1e6 / d.count as f64,
            p50_le_us: d.quantile_bound_us(0.50),
            p90_le_us: d.quantile_bound_us(0.90),
            p99_le_us: d.quantile_bound_us(0.99),
            last_bound_us: d.last_finite_bound_us(),
            name: d.name,
        })
        .collect()
}

/// Server resource use (from `--pid`, or the embedded node's threads).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct ServerUse {
    /// `pid N`, or `embedded` (shard threads only; RSS is the whole process).
    pub source: String,
    pub cpu_s_send_phase: Option<f64>,
    pub cpu_share_send_phase: Option<f64>,
    /// Node CPU from the first CONNECT until every client connected (TLS handshakes,
    /// upgrades, CONNECTs), and per client connected, µs: what a storm costs the node
    /// (with its idle spinning, if it waited on the clients).
    #[serde(default)]
    pub cpu_s_connect_phase: Option<f64>,
    #[serde(default)]
    pub cpu_us_per_connect: Option<f64>,
    /// SENDs answered with a SENDACK of any reason (the send phase and its drain).
    #[serde(default)]
    pub answered_sends: u64,
    /// Node CPU of the send phase (with its drain) per answered SEND, µs. Below
    /// saturation it includes the shards' idle spinning: read it at saturation.
    #[serde(default)]
    pub cpu_us_per_send: Option<f64>,
    /// Node CPU of the send phase (with its drain) per delivered RECV, µs.
    #[serde(default)]
    pub cpu_us_per_recv: Option<f64>,
    pub rss_bytes_before_connect: Option<u64>,
    pub rss_bytes_connected: Option<u64>,
    pub rss_bytes_per_connection: Option<f64>,
}

/// Node CPU per unit in µs: `cpu_s` seconds over `count` units (none without a CPU
/// reading or without units).
pub fn cpu_us_per(cpu_s: Option<f64>, count: u64) -> Option<f64> {
    cpu_s.filter(|_| count > 0).map(|c| c * 1e6 / count as f64)
}

/// The JSON summary of one run.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct Summary {
    pub imbench_version: String,
    pub label: String,
    /// The preset the flags came from and its expansion (`imbench group --preset`).
    #[serde(default)]
    pub preset: Option<String>,
    pub scenario: String,
    pub unix_time_s: u64,
    pub machine: String,
    pub target: String,
    pub transport: String,
    pub encrypt: bool,
    pub threads: usize,
    pub duration_s: f64,
    pub payload_bytes: usize,
    pub floor_rtt: Option<Pcts>,
    pub clients: usize,
    pub connected: u64,
    pub connect: Pcts,
    /// How late the harness made its SENDs after their intended times.
    pub send_lag: Pcts,
    pub connect_phase_s: f64,
    pub activations_per_s: f64,
    pub classes: Vec<ClassSummary>,
    pub send_phase_s: f64,
    pub drained: bool,
    pub errors_total: u64,
    pub errors: serde_json::Value,
    pub dup_flagged_recvs: u64,
    pub harness_cpu_s_connect: f64,
    pub harness_cpu_s_send_phase: f64,
    pub harness_cpu_share_send_phase: f64,
    /// Harness CPU of the send phase per RECV delivered (µs): what the harness takes
    /// from a machine it shares with the node.
    #[serde(default)]
    pub harness_cpu_us_per_recv: f64,
    /// The backend of the harness's `net::io` drivers: `uring`, `epoll`, or `uring (k
    /// of n workers)`.
    #[serde(default)]
    pub io: String,
    /// Read batches (a connection's input of one driver poll) and sends handed to
    /// the driver by the harness in the send phase.
    #[serde(default)]
    pub harness_reads: u64,
    #[serde(default)]
    pub harness_writes: u64,
    pub server: ServerUse,
    pub node_metrics_delta: Vec<(String, i64)>,
    /// The node's own stage histograms over the run (from `/metrics`).
    pub node_stages: Vec<StageSummary>,
    /// Curve points `(percentile, µs)` by histogram name (`floor`, `connect`,
    /// `<class>-recv`, `<class>-sendack`).
    pub curves: Vec<(String, Vec<(f64, f64)>)>,
}

impl Summary {
    /// Whether the accounting is clean: every expected RECV arrived, no error.
    pub fn clean(&self) -> bool {
        self.errors_total == 0
            && self
                .classes
                .iter()
                .all(|c| c.missing_recvs == 0 && c.extra_recvs == 0)
            && self.connected as usize == self.clients
    }
}

fn row(name: &str, p: &Pcts) -> String {
    format!(
        "{:<16} {:>9} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}\n",
        name, p.count, p.p50_us, p.p90_us, p.p99_us, p.p999_us, p.p9999_us, p.max_us
    )
}

/// The terminal table.
pub fn table(s: &Summary) -> String {
    let mut t = String::new();
    latency_rows(&mut t, s);
    if s.scenario == "floor" {
        return t;
    }
    load_lines(&mut t, s);
    harness_line(&mut t, s);
    for st in &s.node_stages {
        let _ = writeln!(t, "{}", st.line());
    }
    server_line(&mut t, &s.server);
    if !s.classes.is_empty() {
        node_cost_line(&mut t, s);
    }
    t
}

/// The run's title line and one latency row per measured histogram.
fn latency_rows(t: &mut String, s: &Summary) {
    let _ = writeln!(
        t,
        "imbench {} [{}] target={} transport={} encrypt={} threads={} duration={:.1}s payload={}B",
        s.scenario,
        s.label,
        s.target,
        s.transport,
        s.encrypt,
        s.threads,
        s.duration_s,
        s.payload_bytes
    );
    if let Some(p) = &s.preset {
        let _ = writeln!(t, "preset {p}");
    }
    let _ = writeln!(
        t,
        "{:<16} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "latency (µs)", "count", "p50", "p90", "p99", "p99.9", "p99.99", "max"
    );
    if let Some(f) = &s.floor_rtt {
        t.push_str(&row("floor (echo RTT)", f));
    }
    if s.connect.count > 0 {
        t.push_str(&row("CONNECT→CONNACK", &s.connect));
    }
    for c in &s.classes {
        t.push_str(&row(&format!("{} SENDACK", c.class), &c.sendack));
        t.push_str(&row(&format!("{} RECV", c.class), &c.recv));
    }
    if s.send_lag.count > 0 {
        t.push_str(&row("harness send lag", &s.send_lag));
    }
}

/// Connects, the accounting of each class, errors.
fn load_lines(t: &mut String, s: &Summary) {
    let _ = writeln!(
        t,
        "clients {}/{} connected in {:.3}s ({:.0} activations/s)",
        s.connected, s.clients, s.connect_phase_s, s.activations_per_s
    );
    for c in &s.classes {
        let _ = writeln!(
            t,
            "{}: rate {:.0}/s sent {} RECVs expected {} delivered {} missing {} extra {} → {:.0} RECV/s",
            c.class, c.rate_per_s, c.sent, c.expected_recvs, c.delivered_recvs, c.missing_recvs,
            c.extra_recvs, c.delivered_per_s
        );
    }
    let _ = writeln!(
        t,
        "errors {} {}  refused-22 {}  dup-flagged {}  drained {}",
        s.errors_total,
        if s.errors_total > 0 {
            s.errors.to_string()
        } else {
            String::new()
        },
        s.errors["sendack_rate_limited"].as_u64().unwrap_or(0),
        s.dup_flagged_recvs,
        s.drained
    );
}

/// The harness's own CPU, reads and writes.
fn harness_line(t: &mut String, s: &Summary) {
    let _ = write!(
        t,
        "harness CPU ({} loop): {:.2}s connect, {:.2}s send phase ({:.0}% of one core)",
        s.io,
        s.harness_cpu_s_connect,
        s.harness_cpu_s_send_phase,
        s.harness_cpu_share_send_phase * 100.0
    );
    if s.harness_cpu_us_per_recv > 0.0 {
        let _ = write!(t, ", {} µs per RECV", fmt_us(s.harness_cpu_us_per_recv));
    }
    let recvs: u64 = s.classes.iter().map(|c| c.delivered_recvs).sum();
    if recvs > 0 && s.harness_reads > 0 && s.harness_writes > 0 {
        let _ = write!(
            t,
            "; {} reads, {} writes ({} RECVs per read, {} per write)",
            s.harness_reads,
            s.harness_writes,
            fmt_us(recvs as f64 / s.harness_reads as f64),
            fmt_us(recvs as f64 / s.harness_writes as f64)
        );
    }
    t.push('\n');
}

/// The server's CPU and memory.
fn server_line(t: &mut String, sv: &ServerUse) {
    let _ = write!(t, "server ({}):", sv.source);
    if let (Some(c), Some(sh)) = (sv.cpu_s_send_phase, sv.cpu_share_send_phase) {
        let _ = write!(
            t,
            " CPU {c:.2}s send phase ({:.0}% of one core)",
            sh * 100.0
        );
    }
    if let (Some(c), Some(per)) = (sv.cpu_s_connect_phase, sv.cpu_us_per_connect) {
        let _ = write!(t, " CPU {c:.2}s connect phase ({per:.1} µs per connect)");
    }
    if let Some(r) = sv.rss_bytes_connected {
        let _ = write!(t, " RSS {:.1} MiB connected", r as f64 / 1048576.0);
    }
    if let Some(p) = sv.rss_bytes_per_connection {
        let _ = write!(t, ", {p:.0} B per connection");
    }
    t.push('\n');
}

/// The node's CPU per answered SEND and per delivered RECV.
fn node_cost_line(t: &mut String, s: &Summary) {
    let sv = &s.server;
    let (Some(cpu), Some(per_send)) = (sv.cpu_s_send_phase, sv.cpu_us_per_send) else {
        let _ = writeln!(
            t,
            "node CPU per SEND unknown (no node CPU reading: pass the node's --pid), \
             per delivered RECV unknown"
        );
        return;
    };
    let _ = write!(
        t,
        "node CPU per SEND {} µs ({cpu:.2}s over {} answered SENDs)",
        fmt_us(per_send),
        sv.answered_sends
    );
    let delivered: u64 = s.classes.iter().map(|c| c.delivered_recvs).sum();
    match sv.cpu_us_per_recv {
        Some(r) => {
            let _ = writeln!(
                t,
                ", per delivered RECV {} µs ({delivered} RECVs)",
                fmt_us(r)
            );
        }
        None => {
            let _ = writeln!(t, ", per delivered RECV none (no RECV delivered)");
        }
    }
}

/// Writes `<label>.json` and one `<label>-<name>.hgrm` per non-empty histogram.
pub fn write_files(dir: &Path, s: &Summary, hists: &[(String, &Histogram<u64>)]) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let json = serde_json::to_string_pretty(s).map_err(io::Error::other)?;
    std::fs::write(dir.join(format!("{}.json", s.label)), json)?;
    for (name, h) in hists {
        if !h.is_empty() {
            write_hgrm(h, &dir.join(format!("{}-{name}.hgrm", s.label)))?;
        }
    }
    Ok(())
}

/// The median of `v` (NaN for none).
fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One figure of a run (NaN where the run has none).
type Figure = fn(&Summary) -> f64;

fn group_recv(s: &Summary) -> Option<&Pcts> {
    s.classes
        .iter()
        .find(|c| c.class == "group")
        .map(|c| &c.recv)
}

/// The rows of [`compare`]: name and figure.
const COMPARED: [(&str, Figure); 8] = [
    ("floor p50 µs", |s| {
        s.floor_rtt.as_ref().map_or(f64::NAN, |f| f.p50_us)
    }),
    ("RECV p50 µs", |s| {
        group_recv(s).map_or(f64::NAN, |p| p.p50_us)
    }),
    ("RECV p90 µs", |s| {
        group_recv(s).map_or(f64::NAN, |p| p.p90_us)
    }),
    ("RECV p99 µs", |s| {
        group_recv(s).map_or(f64::NAN, |p| p.p99_us)
    }),
    ("RECV p99.9 µs", |s| {
        group_recv(s).map_or(f64::NAN, |p| p.p999_us)
    }),
    ("server CPU µs/RECV", |s| {
        s.server.cpu_us_per_recv.unwrap_or(f64::NAN)
    }),
    ("harness CPU µs/RECV", |s| s.harness_cpu_us_per_recv),
    ("RECV p50 / floor p50", |s| {
        let f = s.floor_rtt.as_ref().map_or(f64::NAN, |f| f.p50_us);
        group_recv(s).map_or(f64::NAN, |p| p.p50_us / f)
    }),
];

/// imrouter's runs beside a peer's (interleaved rounds): the median of each figure
/// and their ratio (imrouter / peer), then each round's RECV p50/p99 and accounting.
pub fn compare(node: &[Summary], peer: &[Summary], peer_name: &str) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "\nimrouter vs {peer_name}: medians of {} interleaved round(s)",
        node.len().min(peer.len())
    );
    let _ = writeln!(
        t,
        "{:<22} {:>12} {:>12} {:>16}",
        "figure", "imrouter", peer_name, "imrouter/peer"
    );
    for (name, f) in COMPARED {
        let a = median(node.iter().map(f).collect());
        let b = median(peer.iter().map(f).collect());
        let _ = writeln!(
            t,
            "{:<22} {:>12} {:>12} {:>15.2}×",
            name,
            fmt_fig(a),
            fmt_fig(b),
            a / b
        );
    }
    for (i, (a, b)) in node.iter().zip(peer).enumerate() {
        let _ = writeln!(
            t,
            "round {}: {}  |  {}",
            i + 1,
            round_line(a),
            round_line(b)
        );
    }
    t
}

fn fmt_fig(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.1}")
    } else {
        "-".into()
    }
}

/// A run's RECV p50/p99 and its accounting, on one line.
fn round_line(s: &Summary) -> String {
    let (p50, p99) = group_recv(s).map_or((f64::NAN, f64::NAN), |p| (p.p50_us, p.p99_us));
    let (mut exp, mut got, mut miss, mut extra) = (0, 0, 0, 0);
    for c in &s.classes {
        exp += c.expected_recvs;
        got += c.delivered_recvs;
        miss += c.missing_recvs;
        extra += c.extra_recvs;
    }
    format!(
        "{} p50 {} p99 {} µs, {got}/{exp} RECVs, {miss} missing, {extra} extra, {} dup-flagged, {} errors",
        s.target,
        fmt_fig(p50),
        fmt_fig(p99),
        s.dup_flagged_recvs,
        s.errors_total
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_in_microseconds() {
        let mut h = crate::load::new_hist();
        for v in 1..=1000u64 {
            h.record(v * 1000).unwrap();
        }
        let p = Pcts::of(&h);
        assert_eq!(p.count, 1000);
        assert!((p.p50_us - 500.0).abs() < 1.0, "{p:?}");
        assert!((p.max_us - 1000.0).abs() < 1.0, "{p:?}");
        let c = curve(&h);
        assert!(c.first().unwrap().0 < 1.0 && c.last().unwrap().0 == 100.0);
    }

    /// Two stages with sub-µs bounds, listed `push_hop` first: the summary keeps that
    /// order, takes the difference of the two texts, prints sub-µs bounds as such.
    const BEFORE: &str = "imrouter_stage_push_hop_seconds_bucket{le=\"0.00000025\"} 1\n\
        imrouter_stage_push_hop_seconds_bucket{le=\"0.0000005\"} 1\n\
        imrouter_stage_push_hop_seconds_bucket{le=\"0.000005\"} 1\n\
        imrouter_stage_push_hop_seconds_bucket{le=\"+Inf\"} 1\n\
        imrouter_stage_push_hop_seconds_sum 0.0000002\n\
        imrouter_stage_push_hop_seconds_count 1\n";
    const AFTER: &str = "imrouter_stage_push_hop_seconds_bucket{le=\"0.00000025\"} 31\n\
        imrouter_stage_push_hop_seconds_bucket{le=\"0.0000005\"} 81\n\
        imrouter_stage_push_hop_seconds_bucket{le=\"0.000005\"} 91\n\
        imrouter_stage_push_hop_seconds_bucket{le=\"+Inf\"} 101\n\
        imrouter_stage_push_hop_seconds_sum 0.0000452\n\
        imrouter_stage_push_hop_seconds_count 101\n\
        imrouter_recvs_total 100\n\
        imrouter_stage_append_seconds_bucket{le=\"0.0000001\"} 4\n\
        imrouter_stage_append_seconds_bucket{le=\"+Inf\"} 4\n\
        imrouter_stage_append_seconds_sum 0.0000002\n\
        imrouter_stage_append_seconds_count 4\n\
        imrouter_stage_idle_seconds_bucket{le=\"0.001\"} 0\n\
        imrouter_stage_idle_seconds_bucket{le=\"+Inf\"} 0\n\
        imrouter_stage_idle_seconds_sum 0\n\
        imrouter_stage_idle_seconds_count 0\n";

    #[test]
    fn node_stages_keep_order_and_sub_microsecond_bounds() {
        let st = node_stages(BEFORE, AFTER);
        let names: Vec<&str> = st.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            ["stage_push_hop", "stage_append"],
            "idle has no observations"
        );
        let hop = &st[0];
        assert_eq!(hop.count, 100);
        assert!((hop.mean_us - 0.45).abs() < 1e-9, "{hop:?}");
        assert_eq!(hop.p50_le_us, 0.5);
        assert_eq!(hop.p90_le_us, 5.0);
        assert!(hop.p99_le_us.is_infinite());
        assert_eq!(hop.last_bound_us, 5.0);
        assert_eq!(
            hop.line(),
            "node stage push_hop: 100 observations, mean 0.45 µs, p50 ≤ 0.5 µs, \
             p90 ≤ 5 µs, p99 > 5 µs (bucket bounds)"
        );
        assert_eq!(st[1].p50_le_us, 0.1);
        assert!(st[1].line().contains("p50 ≤ 0.1 µs"), "{}", st[1].line());
    }

    #[test]
    fn node_stages_survive_the_json_summary() {
        let s = Summary {
            node_stages: node_stages(BEFORE, AFTER),
            ..Summary::default()
        };
        let json = serde_json::to_string(&s).unwrap();
        let back: Summary = serde_json::from_str(&json).unwrap();
        assert_eq!(back.node_stages.len(), 2);
        assert_eq!(back.node_stages[0].name, "stage_push_hop");
        assert_eq!(back.node_stages[0].p50_le_us, 0.5);
        assert!(
            back.node_stages[0].p99_le_us.is_infinite(),
            "null reads back"
        );
        assert_eq!(back.node_stages[1].name, "stage_append");
        assert!(table(&back).contains("node stage push_hop: 100 observations"));
    }

    /// The preset's expansion heads the report; the node's CPU per answered SEND and
    /// per delivered RECV follows the server line, and reads "unknown" without a CPU
    /// reading.
    #[test]
    fn header_names_the_preset_and_node_cost_per_message() {
        let mut s = Summary {
            scenario: "group".into(),
            preset: Some("wk-send = --groups 100 (explicit flags override)".into()),
            classes: vec![ClassSummary {
                class: "group".into(),
                delivered_recvs: 400_000,
                sendack: Pcts {
                    count: 200_000,
                    ..Pcts::default()
                },
                ..ClassSummary::default()
            }],
            ..Summary::default()
        };
        let t = table(&s);
        assert_eq!(
            t.lines().nth(1),
            Some("preset wk-send = --groups 100 (explicit flags override)")
        );
        assert!(t.contains("node CPU per SEND unknown"), "{t}");
        s.server.cpu_s_send_phase = Some(5.0);
        s.server.answered_sends = 200_000;
        s.server.cpu_us_per_send = cpu_us_per(Some(5.0), 200_000);
        s.server.cpu_us_per_recv = cpu_us_per(Some(5.0), 400_000);
        let t = table(&s);
        assert!(
            t.contains(
                "node CPU per SEND 25 µs (5.00s over 200000 answered SENDs), \
                 per delivered RECV 12.5 µs (400000 RECVs)"
            ),
            "{t}"
        );
        assert_eq!(cpu_us_per(None, 10), None);
        assert_eq!(cpu_us_per(Some(1.0), 0), None);
    }

    #[test]
    fn fmt_us_keeps_three_significant_digits() {
        assert_eq!(fmt_us(0.25), "0.25");
        assert_eq!(fmt_us(0.123456), "0.123");
        assert_eq!(fmt_us(4.0712), "4.07");
        assert_eq!(fmt_us(12.54), "12.5");
        assert_eq!(fmt_us(182.4), "182");
    }

    #[test]
    fn hgrm_round_trips_through_the_plot_reader() {
        let mut h = crate::load::new_hist();
        for v in 1..=100u64 {
            h.record(v * 10_000).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.hgrm");
        write_hgrm(&h, &p).unwrap();
        let pts = crate::plot::read_hgrm(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert!(!pts.is_empty());
        let last = pts.last().unwrap();
        assert!((last.1 - 1000.0).abs() < 2.0, "{last:?}");
    }

    /// The comparison's medians and ratios come from the runs' own figures.
    #[test]
    fn compare_prints_medians_and_their_ratio() {
        let run = |p50: f64, floor: f64| Summary {
            target: "t".into(),
            floor_rtt: Some(Pcts {
                p50_us: floor,
                ..Pcts::default()
            }),
            classes: vec![ClassSummary {
                class: "group".into(),
                recv: Pcts {
                    p50_us: p50,
                    ..Pcts::default()
                },
                ..ClassSummary::default()
            }],
            ..Summary::default()
        };
        let node = [run(100.0, 50.0), run(300.0, 50.0), run(200.0, 50.0)];
        let peer = [run(50.0, 50.0), run(100.0, 50.0), run(400.0, 50.0)];
        let t = compare(&node, &peer, "redis");
        let line = t.lines().find(|l| l.starts_with("RECV p50 µs")).unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(&words[3..], ["200.0", "100.0", "2.00×"], "{t}");
        assert_eq!(t.lines().filter(|l| l.starts_with("round ")).count(), 3);
    }
}
