//! What the core reported since its driver last looked, for the drivers that answer callers
//! ([`crate::api::runtime`] for [`crate::Node`], [`crate::engine::EngineNode`]): which
//! requests' lookups have new answers, which sources' sessions ended, which stores ended. They
//! come from the core's events ([`kvpeer_core::Event`]), so a driver asks the core again only
//! about what changed instead of re-polling every waiting call on every wake.
//!
//! Filled by [`crate::node::io::NodeIo::step`] on the node's thread, only once a driver asked
//! for it ([`Outcomes::watch`]): a bare `NodeIo` that never takes them keeps nothing.

use std::collections::HashSet;

use kvpeer_core::JobId;
use kvpeer_proto::{KvRequestId, PeerId};

/// Outcomes not taken yet.
#[derive(Debug, Default)]
pub(crate) struct Outcomes {
    watching: bool,
    /// Requests whose lookups may answer now (a `lookup_resp`, a failed load).
    answered: HashSet<KvRequestId>,
    /// Peers whose session ended (its requests' lookups answer MISS now).
    ended: HashSet<PeerId>,
    /// Store jobs that ended: (job, its blocks reached the peer).
    stores: Vec<(JobId, bool)>,
}

/// What [`Outcomes::take`] hands over.
#[derive(Debug, Default)]
pub(crate) struct Taken {
    pub(crate) answered: HashSet<KvRequestId>,
    pub(crate) ended: HashSet<PeerId>,
    pub(crate) stores: Vec<(JobId, bool)>,
}

impl Outcomes {
    /// Starts recording (a driver that will take them).
    pub(crate) fn watch(&mut self) {
        self.watching = true;
    }

    pub(crate) fn lookup_answered(&mut self, id: KvRequestId) {
        if self.watching {
            self.answered.insert(id);
        }
    }

    pub(crate) fn session_ended(&mut self, peer: &PeerId) {
        if self.watching {
            self.ended.insert(peer.clone());
        }
    }

    pub(crate) fn store_done(&mut self, job: JobId, success: bool) {
        if self.watching {
            self.stores.push((job, success));
        }
    }

    /// Everything recorded since the last call.
    pub(crate) fn take(&mut self) -> Taken {
        Taken {
            answered: std::mem::take(&mut self.answered),
            ended: std::mem::take(&mut self.ended),
            stores: std::mem::take(&mut self.stores),
        }
    }
}
