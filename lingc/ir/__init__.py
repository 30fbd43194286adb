"""Tools over the IR graphs: text listing (text), JSON form (serialize), checks (lint), shape inference (shapes)."""
