"""Prometheus metrics of one syncer, on a private registry (several syncers can live in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class SyncerMetrics:
    """Every figure the syncer exports; names start with `diloco_syncer_`."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.outer_steps = Counter("diloco_syncer_outer_steps", "Outer steps (merges) per fragment",
                                   ["fragment"], registry=r)
        self.fragment_version = Gauge("diloco_syncer_fragment_version", "Current version of each fragment",
                                      ["fragment"], registry=r)
        self.contributions_per_merge = Histogram(
            "diloco_syncer_contributions_per_merge", "Contributions merged in one outer step",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.staleness = Histogram(
            "diloco_syncer_staleness_versions", "Outer steps of the fragment between a contribution's base and "
            "the version it was merged into", buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.bytes_in = Counter("diloco_syncer_bytes_received", "Request body bytes received", ["endpoint"],
                                registry=r)
        self.bytes_out = Counter("diloco_syncer_bytes_sent", "Response body bytes sent", ["endpoint"], registry=r)
        self.downlink_bytes = Counter("diloco_syncer_downlink_bytes", "Fragment answer bytes sent, by kind: delta "
                                      "(one update), chain (several), full (the whole fragment)", ["kind"],
                                      registry=r)
        self.downlink_answers = Counter("diloco_syncer_downlink_answers", "Fragment answers sent, by kind",
                                        ["kind"], registry=r)
        self.live_learners = Gauge("diloco_syncer_live_learners", "Learners seen within the liveness timeout",
                                   registry=r)
        self.quorum = Gauge("diloco_syncer_quorum", "Minimum quorum K (outer.quorum): contributions a merge waits "
                            "for, min(K, live learners) when fewer are alive", registry=r)
        self.grace_window = Gauge("diloco_syncer_grace_window_seconds", "Current adaptive grace window",
                                  registry=r)
        self.merge_seconds = Histogram("diloco_syncer_merge_seconds", "Merge + outer step + publish time",
                                       buckets=_SECONDS, registry=r)
        self.accepted = Counter("diloco_syncer_submissions_accepted", "Outer gradients acknowledged (202)",
                                registry=r)
        self.riders = Counter("diloco_syncer_riders_accepted", "Riders acknowledged: restarted learners' resends of "
                              "their previous life's unsent work (each joins its fragment's next merge)", registry=r)
        self.riders_merged = Counter("diloco_syncer_riders_merged", "Riders merged: alone=false in a merge with "
                                     "other learners' contributions (what they wait for), alone=true in one of riders "
                                     "only (their wait ran out, or every live learner had one pending)", ["alone"],
                                     registry=r)
        self.duplicates = Counter("diloco_syncer_submissions_duplicate", "Retried submissions already known",
                                  registry=r)
        self.rejected = Counter("diloco_syncer_submissions_rejected", "Outer gradients rejected, by reason",
                                ["reason"], registry=r)
        self.updates_bounded = Counter("diloco_syncer_updates_bounded", "Outer gradients over their update norm bound "
                                       "(outer.update_bound), by the bound (absolute, relative) and the action "
                                       "(clipped, rejected)", ["reason", "action"], registry=r)
        self.merges_refused = Counter("diloco_syncer_merges_refused", "Merges not committed, by reason (not_finite: "
                                      "the new version or momentum had a NaN or infinity)", ["reason"], registry=r)
        self.uploads_in_progress = Gauge("diloco_syncer_uploads_in_progress", "Submission bodies being decoded now "
                                         "(at most --max-concurrent-uploads; a body takes a slot once it has "
                                         "arrived whole)", registry=r)
        self.uploads_receiving = Gauge("diloco_syncer_uploads_receiving", "Submission bodies arriving now, before "
                                       "they take a decoding slot (a learner's own token: one at a time)", registry=r)
        self.body_timeouts = Counter("diloco_syncer_body_timeouts", "Request bodies cut with 408 for arriving slower "
                                     "than --body-min-rate-kbs after --body-base-s, by endpoint", ["endpoint"],
                                     registry=r)
        self.connections = Gauge("diloco_syncer_connections", "Open HTTP connections (one idle, or without its "
                                 "request's headers, for --keepalive-s is closed)", registry=r)
        self.tokens_merged = Counter("diloco_syncer_tokens_merged", "Learner tokens covered by merged "
                                     "contributions", registry=r)
        self.pending = Gauge("diloco_syncer_pending_contributions", "Contributions waiting for a merge",
                             ["fragment"], registry=r)
        self.checkpoint_seconds = Histogram("diloco_syncer_checkpoint_seconds", "Time to write a checkpoint",
                                            buckets=_SECONDS, registry=r)
        self.checkpoints = Counter("diloco_syncer_checkpoints", "Checkpoints written", registry=r)
        self.checkpoint_fallbacks = Counter(
            "diloco_syncer_checkpoint_fallbacks", "This incarnation: 1 if it found the latest checkpoint damaged "
            "(unreadable, truncated or not its checksums) and started from the previous one", registry=r)
        self.takeover_seconds = Gauge("diloco_syncer_takeover_seconds", "This incarnation: seconds from getting the "
                                      "state directory's lock (its previous holder gone) to serving", registry=r)
        self.state_load_seconds = Gauge("diloco_syncer_state_load_seconds", "This incarnation: seconds to load the "
                                        "checkpoint, spool and merge journal", registry=r)
        self.shard = Gauge("diloco_syncer_shard", "1, labelled with this syncer's shard index and the shard count "
                           "(syncer.shards; fragment p belongs to shard p mod shards)", ["shard", "shards"], registry=r)
        self.owned_fragments = Gauge("diloco_syncer_owned_fragments", "Fragments this syncer shard owns, merges and "
                                     "persists", registry=r)
        self.standby = Gauge("diloco_syncer_standby", "1 if this incarnation was a warm standby that took over",
                             registry=r)

    def render(self) -> bytes:
        """Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
