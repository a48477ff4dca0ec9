//! Helpers shared by the activation and registry tests (`#[path]`-included by them;
//! compiled on its own it is an empty test crate).

// A test driver, outside the sans-IO boundary (clippy.toml): it may read seeds from
// the environment, time itself and run threads.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]
#![allow(dead_code)]

use std::sync::Arc;

use domain::cluster::ClusterView;
use domain::presence::activation::{Activation, ActivationConfig, ActivationId, Event, Output};
use domain::presence::registry::{NewSession, Registry, RegistryConfig};
use domain::presence::route::{
    DeviceLevel, OwnerAction, OwnerActionKind, PendingToken, RouteIdentity, Transport,
};

pub const NODE: u64 = 1;
pub const BOOT: u64 = 0xB007;
pub const SHARD: u16 = 3;

pub fn config() -> RegistryConfig {
    RegistryConfig::new(SHARD, NODE, BOOT)
}

pub fn registry() -> Registry {
    Registry::new(config()).expect("valid config")
}

pub fn view() -> ClusterView {
    ClusterView::single_node(NODE)
}

pub fn session(uid: &str, device_id: &str, flag: u8, level: DeviceLevel, sid: u64) -> NewSession {
    NewSession {
        uid: uid.into(),
        device_id: Arc::from(device_id),
        device_flag: flag,
        device_level: level,
        session_id: sid,
        listener: Transport::Tcp,
        connected_at_ms: 1_000,
    }
}

pub fn simple(uid: &str, sid: u64) -> NewSession {
    session(uid, "dev", 1, DeviceLevel::Master, sid)
}

pub fn start(reg: &mut Registry, new: NewSession, now_ms: u64) -> (Activation, Vec<Output>) {
    start_with(reg, &view(), new, now_ms)
}

pub fn start_with(
    reg: &mut Registry,
    view: &ClusterView,
    new: NewSession,
    now_ms: u64,
) -> (Activation, Vec<Output>) {
    let mut out = Vec::new();
    let id = ActivationId(new.session_id);
    let a = Activation::start(
        id,
        &ActivationConfig::default(),
        reg,
        view,
        new,
        now_ms,
        &mut out,
    );
    (a, out)
}

pub fn step(a: &mut Activation, reg: &mut Registry, event: Event, now_ms: u64) -> Vec<Output> {
    let mut out = Vec::new();
    a.handle_event(reg, event, now_ms, &mut out);
    out
}

/// The token the authority would return for `a`'s registration.
pub fn token_of(a: &Activation, nonce: u64) -> PendingToken {
    PendingToken {
        identity: a.identity().clone(),
        owner_seq: a.owner_seq(),
        nonce,
    }
}

/// An owner action against some other session of `uid`.
pub fn action(uid: &str, session_id: u64, kind: OwnerActionKind) -> OwnerAction {
    OwnerAction {
        kind,
        route: RouteIdentity {
            uid: uid.into(),
            node_id: 2,
            boot_id: 77,
            session_id,
        },
        owner_seq: 5,
    }
}

/// The number of CONNACKs in `out`.
pub fn connacks(out: &[Output]) -> usize {
    out.iter()
        .filter(|o| matches!(o, Output::SendConnack { .. }))
        .count()
}
