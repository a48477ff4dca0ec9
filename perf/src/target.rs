//! The node(s) a run drives: an in-process node (`--embedded`) or external nodes by
//! address, and the control path (tokens, group subscribers, metrics) through the HTTP
//! API — over HTTP with the node's own client (`engine::http::client`), or in-process through
//! [`engine::http::Api`] for the embedded node.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use engine::http::client::BlockingClient;
use engine::node::{Node, NodeConfig};

use crate::conn::Transport;

/// Largest HTTP response body the control client reads.
pub const HTTP_BODY_MAX_BYTES: usize = 16 << 20;
/// Bounds every control request (connect, request and answer).
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);
/// Subscribers per `/channel/subscriber_add` request.
pub const SUBSCRIBERS_PER_REQUEST_MAX: usize = 1_000;

/// The client-facing addresses of one node.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct NodeAddrs {
    pub tcp: Option<SocketAddr>,
    pub ws: Option<SocketAddr>,
    pub wss: Option<SocketAddr>,
    pub api: Option<SocketAddr>,
}

impl NodeAddrs {
    /// The address clients connect to over `transport` (`tls`: the wss listener).
    pub fn client_addr(&self, transport: Transport, tls: bool) -> io::Result<SocketAddr> {
        match (transport, tls) {
            (Transport::Tcp, false) => self.tcp,
            (Transport::WebSocket, false) => self.ws,
            (Transport::WebSocket, true) => self.wss,
            // Not a client transport, or TLS on TCP (the node offers none).
            _ => None,
        }
        .ok_or_else(|| {
            let name = if tls { "wss" } else { transport.name() };
            io::Error::other(format!("node has no {name} address"))
        })
    }
}

/// The control path of a run.
pub enum Control {
    /// The embedded node's API, called in-process.
    Embedded(engine::http::Api),
    Http(BlockingClient),
}

impl Control {
    /// One API call; `Err` for transport failures, `Ok((status, body))` otherwise.
    pub fn call(&self, method: &str, path: &str, body: &str) -> io::Result<(u16, String)> {
        match self {
            Control::Embedded(api) => {
                let r = api.handle(method, path, None, body.as_bytes());
                Ok((r.status, r.body))
            }
            Control::Http(c) => c.request(method, path, body),
        }
    }

    fn ok(&self, path: &str, body: &str) -> io::Result<()> {
        let (status, text) = self.call("POST", path, body)?;
        if status != 200 {
            return Err(io::Error::other(format!("{path}: HTTP {status}: {text}")));
        }
        Ok(())
    }

    /// Stores `token_of(uid)` for each uid (device flag 0, Master).
    pub fn set_tokens(&self, uids: &[String], token_of: impl Fn(&str) -> String) -> io::Result<()> {
        for uid in uids {
            let body = serde_json::json!({"uid": uid, "token": token_of(uid), "device_flag": 0, "device_level": 1});
            self.ok("/user/token", &body.to_string())?;
        }
        Ok(())
    }

    /// Makes `members` the subscribers of group `channel_id` (replacing any).
    pub fn set_group(&self, channel_id: &str, members: &[String]) -> io::Result<()> {
        for (i, chunk) in members.chunks(SUBSCRIBERS_PER_REQUEST_MAX).enumerate() {
            let body = serde_json::json!({"channel_id": channel_id, "channel_type": 2,
                "reset": u8::from(i == 0), "subscribers": chunk});
            self.ok("/channel/subscriber_add", &body.to_string())?;
        }
        Ok(())
    }

    /// The node's `/metrics` text, empty if unavailable.
    pub fn metrics_text(&self) -> String {
        match self.call("GET", "/metrics", "") {
            Ok((200, text)) => text,
            _ => String::new(),
        }
    }

    /// The node's counters from `/metrics` (totals only), empty if unavailable.
    pub fn metrics(&self) -> Vec<(String, u64)> {
        Self::counters(&self.metrics_text())
    }

    /// Unlabelled integer samples of a `/metrics` text (the totals).
    pub fn counters(text: &str) -> Vec<(String, u64)> {
        text.lines()
            .filter(|l| l.starts_with("imrouter_") && !l.contains('{') && !l.contains("_seconds_"))
            .filter_map(|l| {
                let (k, v) = l.split_once(' ')?;
                Some((
                    k.trim_start_matches("imrouter_").to_string(),
                    v.trim().parse().ok()?,
                ))
            })
            .collect()
    }
}

/// One Prometheus histogram of the node (`imrouter_<name>_seconds`): cumulative
/// buckets `(upper bound s, count)`, sum and count.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PromHist {
    pub name: String,
    pub buckets: Vec<(f64, u64)>,
    pub sum_s: f64,
    pub count: u64,
}

impl PromHist {
    /// Every unlabelled-but-`le` `imrouter_*_seconds` histogram in a `/metrics` text.
    pub fn parse_all(text: &str) -> Vec<PromHist> {
        let mut out: Vec<PromHist> = Vec::new();
        fn entry<'a>(out: &'a mut Vec<PromHist>, name: &str) -> &'a mut PromHist {
            if let Some(i) = out.iter().position(|h| h.name == name) {
                return &mut out[i];
            }
            out.push(PromHist {
                name: name.into(),
                ..PromHist::default()
            });
            let last = out.len() - 1;
            &mut out[last]
        }
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("imrouter_") else {
                continue;
            };
            let Some((key, value)) = rest.rsplit_once(' ') else {
                continue;
            };
            if let Some((name, le)) = key.split_once("_seconds_bucket{le=\"") {
                let le = le.trim_end_matches("\"}");
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    match le.parse() {
                        Ok(b) => b,
                        Err(_) => continue,
                    }
                };
                if let Ok(v) = value.parse() {
                    entry(&mut out, name).buckets.push((bound, v));
                }
            } else if let Some(name) = key.strip_suffix("_seconds_sum") {
                entry(&mut out, name).sum_s = value.parse().unwrap_or(0.0);
            } else if let Some(name) = key.strip_suffix("_seconds_count") {
                entry(&mut out, name).count = value.parse().unwrap_or(0);
            }
        }
        out
    }

    /// `self - before` (the observations made in between).
    pub fn minus(&self, before: Option<&PromHist>) -> PromHist {
        let Some(b) = before else {
            return self.clone();
        };
        PromHist {
            name: self.name.clone(),
            buckets: self
                .buckets
                .iter()
                .map(|(le, c)| {
                    let old = b.buckets.iter().find(|(l, _)| l == le).map_or(0, |x| x.1);
                    (*le, c.saturating_sub(old))
                })
                .collect(),
            sum_s: self.sum_s - b.sum_s,
            count: self.count.saturating_sub(b.count),
        }
    }

    /// Upper bound (µs) of the bucket holding quantile `q` (infinite past the last
    /// finite bound), to 6 significant digits: `le="0.0000005"` is `0.5`, not
    /// `0.49999999999999994`.
    pub fn quantile_bound_us(&self, q: f64) -> f64 {
        let want = (q * self.count as f64).ceil() as u64;
        self.buckets
            .iter()
            .find(|(_, c)| *c >= want.max(1))
            .map_or(f64::INFINITY, |(le, _)| seconds_to_us(*le))
    }

    /// The largest finite bucket bound (µs), 0 if there is none.
    pub fn last_finite_bound_us(&self) -> f64 {
        seconds_to_us(
            self.buckets
                .iter()
                .map(|(le, _)| *le)
                .filter(|le| le.is_finite())
                .fold(0.0, f64::max),
        )
    }
}

/// Seconds to µs, rounded to 6 significant digits (infinite stays infinite).
pub fn seconds_to_us(s: f64) -> f64 {
    round_significant(s * 1e6, 6)
}

/// `v` rounded to `digits` significant decimal digits.
pub fn round_significant(v: f64, digits: i32) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let scale = 10f64.powi(digits - 1 - v.abs().log10().floor() as i32);
    (v * scale).round() / scale
}

/// What a run drives.
pub struct Target {
    pub nodes: Vec<NodeAddrs>,
    pub control: Control,
    /// The in-process node (and its data directory), if embedded.
    pub embedded: Option<(Node, tempfile::TempDir)>,
}

impl Target {
    /// Starts an in-process node on loopback port 0 with `shards` shards (0: one per
    /// core), its data in a fresh temporary directory, and a wss listener when `tls`
    /// names a certificate and key.
    /// `fsync` is the log's sync policy (the `imrouter` binary's default is `Always`).
    pub fn embedded(
        shards: u16,
        fsync: engine::store::FsyncPolicy,
        tls: Option<&net::io::TlsConfig>,
    ) -> io::Result<Target> {
        let dir = tempfile::Builder::new().prefix("imbench-node-").tempdir()?;
        let mut c = NodeConfig {
            data_dir: dir.path().to_path_buf(),
            tcp_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            ws_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            ..NodeConfig::default()
        };
        c.api.addr = None;
        c.log.fsync = fsync;
        if let Some(tls) = tls {
            c.wss_addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
            c.tls =
                Some(net::io::TlsServer::load(tls).map_err(|e| io::Error::other(e.to_string()))?);
        }
        if shards > 0 {
            c.runtime.shard_count = shards;
        }
        let node = Node::start(c)?;
        let addrs = NodeAddrs {
            tcp: node.tcp_addr(),
            ws: node.ws_addr(),
            wss: node.wss_addr(),
            api: None,
        };
        let control = Control::Embedded(node.api());
        Ok(Target {
            nodes: vec![addrs],
            control,
            embedded: Some((node, dir)),
        })
    }

    /// External nodes: comma-separated lists of the same length (or empty); the
    /// control path uses the first API address.
    pub fn external(
        tcp: &[SocketAddr],
        ws: &[SocketAddr],
        wss: &[SocketAddr],
        api: &[SocketAddr],
        bearer: Option<String>,
    ) -> io::Result<Target> {
        let n = tcp.len().max(ws.len()).max(wss.len()).max(api.len());
        if n == 0 {
            return Err(io::Error::other("no node address given"));
        }
        let nodes = (0..n)
            .map(|i| NodeAddrs {
                tcp: tcp.get(i).copied(),
                ws: ws.get(i).copied(),
                wss: wss.get(i).copied(),
                api: api.get(i).copied(),
            })
            .collect();
        let api0 = api
            .first()
            .copied()
            .ok_or_else(|| io::Error::other("--api is required with an external node"))?;
        Ok(Target {
            nodes,
            control: Control::Http(BlockingClient::new(
                api0,
                bearer.as_deref(),
                HTTP_TIMEOUT,
                HTTP_BODY_MAX_BYTES,
            )?),
            embedded: None,
        })
    }

    /// Stops the embedded node (if any) and removes its data.
    pub fn shutdown(self) -> io::Result<()> {
        if let Some((node, dir)) = self.embedded {
            node.shutdown()?;
            drop(dir);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# TYPE imrouter_recv_latency_seconds histogram\n\
        imrouter_recv_latency_seconds_bucket{le=\"0.00001\"} 5\n\
        imrouter_recv_latency_seconds_bucket{le=\"0.0001\"} 90\n\
        imrouter_recv_latency_seconds_bucket{le=\"+Inf\"} 100\n\
        imrouter_recv_latency_seconds_sum 0.004\n\
        imrouter_recv_latency_seconds_count 100\n\
        imrouter_recvs_total 100\n\
        imrouter_shard_recvs_total{shard=\"0\"} 60\n";

    #[test]
    fn parses_stage_histograms_and_counters() {
        let h = PromHist::parse_all(TEXT);
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].name, "recv_latency");
        assert_eq!(h[0].count, 100);
        assert_eq!(h[0].buckets.len(), 3);
        assert_eq!(h[0].quantile_bound_us(0.5), 100.0);
        assert!(h[0].quantile_bound_us(0.99).is_infinite());
        let d = h[0].minus(Some(&h[0]));
        assert_eq!(d.count, 0);
        assert_eq!(
            Control::counters(TEXT),
            vec![("recvs_total".to_string(), 100)]
        );
    }
}
