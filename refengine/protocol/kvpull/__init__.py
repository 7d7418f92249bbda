"""refengine's own protos: refengine.kvpull.v1."""
