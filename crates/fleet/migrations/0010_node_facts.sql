-- The checkpoint store a node uses when it is a bucket (s3://bucket/prefix),
-- so a create from a checkpoint in a bucket several nodes share may be made
-- on any of them; volumes and datasets are now named with their tenant
-- (tenant/name, /name for the operator's, */name for a dataset every
-- tenant may mount), which needs no change of column.

ALTER TABLE runbox_nodes ADD COLUMN checkpoint_store text;

-- The highest lease generation ever published for each run: a fencing
-- number never goes back, whichever node publishes the run next.
ALTER TABLE runbox_runs ADD COLUMN lease_generation bigint NOT NULL DEFAULT 0;

-- What each node's lane can do (allowlist, open, suspend, hibernate, ...),
-- as its heartbeat says.
ALTER TABLE runbox_nodes ADD COLUMN capabilities text[] NOT NULL DEFAULT '{}';
