"""An on-disk spool: processes append records now, one shipper delivers them when it can
(``store``: the files and the writer; ``ship``: the shipper)."""
