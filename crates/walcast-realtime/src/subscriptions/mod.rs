//! The subscriptions the fronts register ([`registrar`]): validated against the realtime
//! tables and their columns ([`validate`]), kept by class ([`matcher`]: a change's candidate
//! classes), matched against each change ([`narrow`], on the rows [`row_view`]
//! presents, on the project's delivery lane), and the fronts they come from ([`fronts`]).

pub mod fronts;
pub mod matcher;
pub mod narrow;
pub mod registrar;
pub mod row_view;
pub mod validate;
