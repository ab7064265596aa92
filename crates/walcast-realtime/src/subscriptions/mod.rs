//! The subscriptions the fronts register: validated against the realtime tables and
//! their columns ([`registrar`]), matched against each change ([`matcher`], on the rows
//! [`row_view`] presents), and the fronts they come from ([`fronts`]).

pub mod fronts;
pub mod matcher;
pub mod registrar;
pub mod row_view;
