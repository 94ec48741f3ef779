-- What placement reads of each node besides its images: the volumes it
-- holds and the datasets it serves (by name), so a create that mounts them
-- is made where they are.

ALTER TABLE runbox_nodes ADD COLUMN volumes text[] NOT NULL DEFAULT '{}';
