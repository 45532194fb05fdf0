//! Supported CNI versions, negotiation and the VERSION answer.
