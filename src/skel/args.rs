//! CNI_ARGS (`K=V;K=V`) parsing with libcni's IgnoreUnknown rule.
