//! Changing a run's egress policy while it lives (`PATCH
//! /v1/runs/{id}/egress`): checked here against the tier, the node's
//! secrets and the tenant's rules and merged with the run's policy by the
//! run's owner, which puts it in force in the same step (see
//! `RunActor::change_egress`).

use runbox_types::{ErrorCode, NetworkTier, Run, UpdateEgressRequest};
use ulid::Ulid;

use super::actor::Command;
use super::{Manager, RunContext};
use crate::egress::{self, RunEgressRequest};
use crate::error::CoreError;
use crate::store::RunRecord;

impl Manager {
    /// Replaces run `id`'s egress entries, secrets and tier (between
    /// `none` and `allowlist`) without restarting it. A field the request
    /// leaves out keeps what the run has; a change of tier starts from
    /// nothing but what the request gives.
    ///
    /// The request is merged with the run's policy by the run's owner, in
    /// the same step that puts the result in force ([`plan`]): two
    /// PATCHes at once each see what the other did, never a snapshot from
    /// before it.
    pub async fn update_egress(
        &self,
        id: Ulid,
        req: UpdateEgressRequest,
    ) -> Result<Run, CoreError> {
        let handle = self.handle(id)?;
        handle
            .ask(|reply| Command::Egress {
                req: Box::new(req),
                reply,
            })
            .await?;
        Ok(self.view(&handle))
    }
}

/// The tier and policy `req` gives a run whose record is `current`: the
/// request checked against the tier, the node's secrets and the tenant's
/// rules, with what it leaves out kept from `current`. Called by the run's
/// owner with its record of the moment.
pub(crate) fn plan(
    context: &RunContext,
    current: &RunRecord,
    req: &UpdateEgressRequest,
) -> Result<(NetworkTier, RunEgressRequest), CoreError> {
    let network = req.network.unwrap_or(current.network);
    if (network == NetworkTier::Open) != (current.network == NetworkTier::Open) {
        return Err(CoreError::invalid(
            ErrorCode::BadEgress,
            format!(
                "a run's tier changes only between \"none\" and \"allowlist\" (this one is {:?}): \
                 an open run has a route of its own that runbox does not take away from under \
                 its processes, and a run is open only when made so; create a run (or fork \
                 this one) on the tier you need",
                current.network.as_str()
            ),
        ));
    }
    context
        .owner_of(current.tenant.as_deref())
        .check_network(network)?;
    let mut next = egress::check_request(
        context.config().egress.as_deref(),
        context.config().sealer.as_deref(),
        network,
        req.into(),
    )?;
    // The class is the tenant's, given at creation; no change of the
    // run's policy unbinds it.
    next.class = current.egress.class.clone();
    if network == NetworkTier::Allowlist && current.network == NetworkTier::Allowlist {
        if req.egress_allow.is_none() {
            next.allow = current.egress.allow.clone();
        }
        if req.egress_defaults.is_none() {
            next.no_defaults = current.egress.no_defaults;
        }
        if req.egress_socks5.is_none() {
            next.socks5 = current.egress.socks5;
        }
        if req.egress_upstream.is_none() {
            next.upstream = current.egress.upstream.clone();
        }
        if req.secrets.is_none() {
            next.secrets = current.egress.secrets.clone();
            next.brought = current.egress.brought.clone();
        }
    }
    Ok((network, next))
}
