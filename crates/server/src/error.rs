//! One error type for every response: `{"error": {"code", "message"}}` with
//! the status that goes with the code. Faults of runbox itself (5xx) show a
//! generic message; the detail goes to the log only.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use runbox_core::CoreError;
use runbox_types::{ErrorBody, ErrorCode, ErrorDetail};

/// `Retry-After` of a `429 capacity`, in seconds.
const RETRY_CAPACITY_SECS: u32 = 1;

/// `Retry-After` of a `503 draining`, in seconds.
const RETRY_DRAINING_SECS: u32 = 30;

/// `Retry-After` of a `503 cluster_unavailable`, in seconds.
const RETRY_CLUSTER_SECS: u32 = 2;

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    code: ErrorCode,
    message: String,
}

impl ApiError {
    /// An error with `code` and a message for the client.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
        }
    }

    /// The error's code.
    pub fn code(&self) -> ErrorCode {
        self.code
    }

    /// The error as an API body carries it.
    pub fn detail(&self) -> ErrorDetail {
        ErrorDetail {
            code: self.code.as_str().to_owned(),
            message: self.message.clone(),
        }
    }

    /// The message for the client.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<CoreError> for ApiError {
    fn from(e: CoreError) -> ApiError {
        let code = e.code();
        if code.status() >= 500 {
            let chain = runbox_core::runs::error_chain(&e);
            let message = match code {
                // The caller's situation, not a fault of runbox's (nothing
                // listens on the port, the node is cordoned): said as it
                // is, and not an error in the server's log.
                ErrorCode::PortUnreachable | ErrorCode::Draining => {
                    tracing::info!(error = %chain, code = %code, "request refused");
                    return ApiError {
                        code,
                        message: e.to_string(),
                    };
                }
                // A service runbox depends on: the message is what the
                // user needs.
                ErrorCode::RegistryError
                | ErrorCode::CheckpointStoreUnavailable
                | ErrorCode::ClusterUnavailable
                | ErrorCode::NodeUnavailable => {
                    tracing::warn!(error = %chain, code = %code, "request failed");
                    return ApiError {
                        code,
                        message: e.to_string(),
                    };
                }
                ErrorCode::AgentUnavailable => {
                    "the run's agent did not answer as expected; see the server log"
                }
                _ => "internal error; see the server log",
            };
            tracing::error!(error = %chain, code = %code, "request failed");
            return ApiError {
                code,
                message: message.to_owned(),
            };
        }
        ApiError {
            code,
            message: e.to_string(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.as_str().to_owned(),
                message: self.message,
            },
        };
        let mut response = (status, Json(body)).into_response();
        // For the metrics, which count errors by code.
        response.extensions_mut().insert(self.code);
        // Capacity comes back as runs end; a cordoned node serves again
        // once it is uncordoned or restarted.
        let retry = match self.code {
            ErrorCode::Capacity | ErrorCode::TenantQuota => Some(RETRY_CAPACITY_SECS),
            ErrorCode::Draining => Some(RETRY_DRAINING_SECS),
            ErrorCode::ClusterUnavailable | ErrorCode::NodeUnavailable | ErrorCode::RunMoved => {
                Some(RETRY_CLUSTER_SECS)
            }
            ErrorCode::CheckpointStoreUnavailable => {
                Some(runbox_core::checkpoints::RETRY_AFTER.as_secs() as u32)
            }
            _ => None,
        };
        if let Some(secs) = retry {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}
