"""The decode op, `kda.fused_recurrent_kda`: the contract (`spec`), the float64 reference (`reference`),
the public functions (`api`) and the gate (`gate`). See docs/design.md, "The decode op".

This package's own import loads nothing but itself: backends import `kda.recurrent.spec`, and the public
API (which needs the dispatcher) lives in `kda.recurrent.api`.
"""
