-- Volumes move between nodes through the checkpoint bucket. Each move is a
-- row of its own, kept: the node a volume leaves writes it (`moving`), and
-- the move ends in one compare-and-set from `moving`, to `arrived` by the
-- node it goes to once that node has the volume whole, or to `back` by
-- either node when it did not get there. Whichever comes first decides, so
-- the volume is never kept, or dropped, on both nodes. A volume has at most
-- one move under way.

CREATE TABLE runbox_volume_moves (
    move_id     text PRIMARY KEY,
    volume      text NOT NULL,
    from_node   text NOT NULL,
    to_node     text NOT NULL,
    state       text NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    settled_at  timestamptz
);

CREATE UNIQUE INDEX runbox_volume_moves_one ON runbox_volume_moves (volume)
    WHERE state = 'moving';
