-- The warm-pool set of each cell: nodes started with the same --cell share
-- the set PUT /v1/pools applies (each node keeps the targets itself), so a
-- PUT on any node of the cell sets every node's. Changes are announced on
-- the runbox_pools channel, with the cell's name.

CREATE TABLE runbox_pool_sets (
    cell        text PRIMARY KEY,
    pools       jsonb NOT NULL,
    generation  bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
