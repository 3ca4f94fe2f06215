//go:build tools

// Package tools makes `go mod tidy` keep everything cmd/kyverno needs.
package tools

import _ "github.com/kyverno/kyverno/cmd/kyverno"
