-- What placement reads of each node besides its load: the images it
-- stores (local names and the references they were pulled from) and the
-- images its warm pools have ready members of.

ALTER TABLE runbox_nodes ADD COLUMN images text[] NOT NULL DEFAULT '{}';
ALTER TABLE runbox_nodes ADD COLUMN pooled text[] NOT NULL DEFAULT '{}';
