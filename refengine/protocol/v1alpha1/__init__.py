"""Generated bindings of refengine's own ``refengine.v1alpha1`` protos (not OpenEngine).

Written by ``scripts/gen_proto.py``; do not edit.
"""
