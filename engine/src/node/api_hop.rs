//! The hop `Api`: the HTTP API's requests homed on another node (a token, a
//! channel's messages or subscribers) and its shares of one (online status, device
//! quit) travel on the inter-node links, authenticated and sealed like every hop,
//! never as plain HTTP between the nodes' APIs.
//!
//! Asking side: the API hands [`Msg::ApiForward`] to any shard, which sends the
//! request on its link to the node (`Kind::ApiRequest`, with the API's
//! `forward_timeout_ms` as its deadline); the reply, or what
//! `domain::hop::on_no_answer` gives when none comes, goes back on the call's
//! channel (`hops.rs`). Serving side: the shard whose link read the request queues
//! it for this node's API ([`NodeShared::api_inbox`](super::shared::NodeShared),
//! bounded; full or absent: 503 at once); the API answers it as if it had arrived
//! here, from this node's data only, and hands the answer back to that shard
//! ([`Msg::ApiAnswered`]), which replies while the request is in time.

use net::io::NetDriver;
use shard::runtime::Context;

use super::msg::{ApiAnswered, ApiForward, Msg, PeerApiCall, Pending, ReplyTo};
use super::shard::{NodeShard, NodeTimer};
use super::wire;

/// The answer to an API request this node cannot serve now.
fn unavailable(why: &str) -> wire::Reply {
    let body = serde_json::json!({ "status": 503, "msg": why }).to_string();
    wire::Reply::Api { status: 503, body }
}

impl NodeShard {
    /// The API asks another node: the request goes on this shard's link to it.
    pub(super) fn on_api_forward(&mut self, cx: &mut Context<Msg, NodeTimer>, f: ApiForward) {
        let request = wire::Request::Api(Box::new(f.call));
        let pending = Pending::Api { answer: f.answer };
        self.request_remote_within(cx, f.node, request, pending, f.deadline_ms);
    }

    /// Another node's API request, read by this shard's link: queued for this
    /// node's API, or answered 503 at once when the queue is full or no API runs.
    pub(super) fn on_api_request(
        &mut self,
        cx: &mut Context<Msg, NodeTimer>,
        driver: &mut NetDriver,
        reply_to: ReplyTo,
        call: Box<wire::ApiCall>,
    ) {
        let ReplyTo::Node(from) = reply_to else {
            // The API asks other nodes only: a shard of this node never sends one.
            let reply = unavailable("an API request between shards");
            return self.answer(cx, driver, reply_to, reply);
        };
        let refused = &self.shared.api_metrics.peer_requests_refused;
        let Some(inbox) = self.shared.api_inbox.get() else {
            crate::http::ApiMetrics::inc(refused);
            let reply = unavailable("this node runs no HTTP API ([listen] api_addr)");
            return self.answer(cx, driver, reply_to, reply);
        };
        let queued = PeerApiCall {
            from,
            shard: self.me,
            call,
        };
        if inbox.try_send(queued).is_err() {
            crate::http::ApiMetrics::inc(refused);
            let reply = unavailable("the API is busy ([api] waiting_requests_max); retry");
            self.answer(cx, driver, ReplyTo::Node(from), reply);
        }
    }

    /// This node's API answered another node's request: the reply goes back on the
    /// link, while in time.
    pub(super) fn on_api_answered(&mut self, cx: &mut Context<Msg, NodeTimer>, a: ApiAnswered) {
        let reply = wire::Reply::Api {
            status: a.status,
            body: a.body,
        };
        self.reply_remote(cx, a.to, reply);
    }
}
