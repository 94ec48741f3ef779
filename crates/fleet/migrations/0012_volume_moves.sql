-- Volumes move between nodes through the checkpoint bucket. A move is one
-- row per volume: the node it leaves writes it (`moving`), and the move
-- ends in one compare-and-set from `moving`, to `arrived` by the node it
-- goes to once that node has the volume whole, or to `back` by either node
-- when it did not get there. Whichever comes first decides, so the volume
-- is never kept, or dropped, on both nodes. A volume has one row, its
-- latest move (`move_id`): a decision is about that move only.

CREATE TABLE runbox_volume_moves (
    volume      text PRIMARY KEY,
    move_id     text NOT NULL,
    from_node   text NOT NULL,
    to_node     text NOT NULL,
    state       text NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    settled_at  timestamptz
);
