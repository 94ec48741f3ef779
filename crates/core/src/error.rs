//! The core's error type and its mapping onto the API's stable codes.

use runbox_types::ErrorCode;
use ulid::Ulid;

use crate::lane::LaneError;
use crate::lease::LeaseError;

/// Everything a core operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// The caller's input breaks a rule; the message says which and how to fix it.
    #[error("{message}")]
    Invalid {
        /// The stable code for the rule.
        code: ErrorCode,
        /// What to fix.
        message: String,
    },
    /// No run with this id.
    #[error("no run with id {0}")]
    RunNotFound(Ulid),
    /// No image with this name.
    #[error("no image named {0:?}; import one with `runbox image import`")]
    ImageNotFound(String),
    /// The run exists but cannot take the operation now.
    #[error("run {0} is {1}")]
    RunNotRunning(Ulid, &'static str),
    /// The run's sandbox died on its own; the reason says how.
    #[error("run {0} has failed ({1}); delete it, or let its TTL pass")]
    RunFailed(Ulid, String),
    /// A conflict with existing state (name taken, image in use).
    #[error("{message}")]
    Conflict {
        /// The stable code.
        code: ErrorCode,
        /// What conflicts.
        message: String,
    },
    /// The run's writable lease refuses the operation.
    #[error(transparent)]
    Lease(#[from] crate::lease::LeaseError),
    /// The node is cordoned.
    #[error("this server is draining (POST /v1/drain) and takes no new runs; use another node, or DELETE /v1/drain")]
    Draining,
    /// Too many runs already.
    #[error("this server already has {0} runs, its maximum; delete some or raise --max-runs")]
    Capacity(usize),
    /// The caller's tenant is at its `maxRuns`.
    #[error("tenant {tenant:?} already has {max} live runs, its maxRuns; delete some or ask the operator to raise it")]
    TenantQuota {
        /// The tenant.
        tenant: String,
        /// Its maxRuns.
        max: u32,
    },
    /// The run's agent misbehaved or did not answer.
    #[error("the run's agent failed: {0}")]
    Agent(String),
    /// The isolation lane failed, or cannot do what was asked on this
    /// host; its own message says which (a 4xx shows it to the caller).
    #[error(transparent)]
    Lane(#[from] LaneError),
    /// The state store failed.
    #[error("the state store failed: {0}")]
    Store(String),
    /// Local I/O failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl CoreError {
    /// An input error with `code`.
    pub fn invalid(code: ErrorCode, message: impl Into<String>) -> CoreError {
        CoreError::Invalid {
            code,
            message: message.into(),
        }
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> CoreError {
        let context = context.into();
        move |source| CoreError::Io { context, source }
    }

    /// The stable API code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            CoreError::Invalid { code, .. } | CoreError::Conflict { code, .. } => *code,
            CoreError::RunNotFound(_) => ErrorCode::RunNotFound,
            CoreError::ImageNotFound(_) => ErrorCode::ImageNotFound,
            CoreError::RunNotRunning(..) => ErrorCode::RunNotRunning,
            CoreError::RunFailed(..) => ErrorCode::RunFailed,
            CoreError::Capacity(_) => ErrorCode::Capacity,
            CoreError::TenantQuota { .. } => ErrorCode::TenantQuota,
            CoreError::Draining => ErrorCode::Draining,
            CoreError::Lease(e) => match e {
                LeaseError::Busy(_) => ErrorCode::Busy,
                LeaseError::Leased { .. } => ErrorCode::Leased,
                LeaseError::Superseded { .. } => ErrorCode::Superseded,
                LeaseError::Expired { .. } => ErrorCode::LeaseExpired,
                LeaseError::NotLeased { .. } => ErrorCode::NotLeased,
            },
            CoreError::Agent(_) => ErrorCode::AgentUnavailable,
            CoreError::Lane(LaneError::Unsupported(_)) => ErrorCode::NetworkUnsupported,
            CoreError::Lane(_) | CoreError::Store(_) | CoreError::Io { .. } => ErrorCode::Internal,
        }
    }
}
