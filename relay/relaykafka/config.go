package relaykafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/onceflow/onceflow/relay"
)

// DefaultClientID is the client id the sink gives the brokers when Config.ClientID is empty.
const DefaultClientID = "onceflow-relay"

// DefaultCompression is the codec of record batches when Config.Compression is empty: snappy,
// franz-go's default and what the sink always used. It is cheap on CPU, every Kafka client
// decodes it, and a batch goes out compressed only when that makes it smaller.
const DefaultCompression = "snappy"

// SASL mechanisms, for SASLConfig.Mechanism.
const (
	SASLPlain       = "PLAIN"
	SASLScramSHA256 = "SCRAM-SHA-256"
	SASLScramSHA512 = "SCRAM-SHA-512"
)

// TLSConfig makes the sink reach the brokers over TLS (Kafka's SSL and SASL_SSL listeners).
// The zero value is plaintext. Setting any field turns TLS on; Enabled alone turns it on with
// the system's root CAs and no client certificate, which is what managed Kafka services need.
type TLSConfig struct {
	// Enabled turns TLS on. It is implied by every other field.
	Enabled bool
	// CAFile is a PEM file of the CA certificates that sign the brokers' certificates, for
	// clusters whose CA is not among the system's roots (a private CA, Strimzi's cluster CA).
	// Default: the system's roots.
	CAFile string
	// CertFile and KeyFile are a PEM client certificate and its private key, for clusters that
	// authenticate clients by certificate (mutual TLS, ssl.client.auth=required). Set both or
	// neither. Default: no client certificate.
	CertFile string
	// KeyFile is the private key of CertFile, in PEM.
	KeyFile string
	// ServerName is the name the brokers' certificates must carry when it is not the host of
	// the broker address: brokers reached by IP address, through a tunnel or a proxy. Default:
	// the host of each broker address (as the client dials it), so that it rarely needs setting.
	ServerName string
}

func (t TLSConfig) enabled() bool {
	return t.Enabled || t.CAFile != "" || t.CertFile != "" || t.KeyFile != "" || t.ServerName != ""
}

// config reads the files and builds the client's TLS configuration, reporting every problem.
func (t TLSConfig) config() (*tls.Config, []error) {
	if !t.enabled() {
		return nil, nil
	}
	var problems []error
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: t.ServerName}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		switch {
		case err != nil:
			problems = append(problems, fmt.Errorf("TLS.CAFile (--kafka-tls-ca-file): %w", err))
		default:
			cfg.RootCAs = x509.NewCertPool()
			if !cfg.RootCAs.AppendCertsFromPEM(pem) {
				problems = append(problems, fmt.Errorf("TLS.CAFile (--kafka-tls-ca-file) %s holds no PEM certificate: give the CA certificate(s), \"-----BEGIN CERTIFICATE-----\" blocks", t.CAFile))
			}
		}
	}
	switch {
	case t.CertFile != "" && t.KeyFile != "":
		cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			problems = append(problems, fmt.Errorf("TLS client certificate %s with key %s (--kafka-tls-cert-file, --kafka-tls-key-file): %w", t.CertFile, t.KeyFile, err))
		} else {
			cfg.Certificates = []tls.Certificate{cert}
		}
	case t.CertFile != "":
		problems = append(problems, errors.New("TLS.CertFile is set without TLS.KeyFile: give the client certificate's private key too (--kafka-tls-key-file)"))
	case t.KeyFile != "":
		problems = append(problems, errors.New("TLS.KeyFile is set without TLS.CertFile: give the client certificate too (--kafka-tls-cert-file)"))
	}
	return cfg, problems
}

// SASLConfig makes the sink authenticate with SASL (Kafka's SASL_PLAINTEXT and SASL_SSL
// listeners). The zero value is no authentication. PLAIN sends the password as it is: use it
// over TLS only. SCRAM never sends it.
type SASLConfig struct {
	// Mechanism is SASLPlain, SASLScramSHA256 or SASLScramSHA512 (in any case). Empty means
	// no SASL, and then User and Password must be empty too.
	Mechanism string
	// User is the SASL user name.
	User string
	// Password is the user's password. String and LogValue leave it out, so printing or logging
	// the config does not show it.
	Password string
}

// String describes the SASL settings without the password.
func (s SASLConfig) String() string {
	if s.Mechanism == "" && s.User == "" && s.Password == "" {
		return "no SASL"
	}
	pw := "no password"
	if s.Password != "" {
		pw = "password set"
	}
	return fmt.Sprintf("SASL %s user %q (%s)", s.Mechanism, s.User, pw)
}

// GoString is String, so that %#v does not show the password either.
func (s SASLConfig) GoString() string { return s.String() }

// LogValue logs the SASL settings without the password.
func (s SASLConfig) LogValue() slog.Value {
	return slog.GroupValue(slog.String("mechanism", s.Mechanism), slog.String("user", s.User), slog.Bool("password_set", s.Password != ""))
}

// mechanism validates s and returns its franz-go mechanism (nil for no SASL).
func (s SASLConfig) mechanism() (kgo.Opt, []error) {
	if s.Mechanism == "" {
		if s.User != "" || s.Password != "" {
			return nil, []error{errors.New("a SASL user or password is set but no SASL.Mechanism: set it (--kafka-sasl-mechanism) to PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")}
		}
		return nil, nil
	}
	var problems []error
	if s.User == "" {
		problems = append(problems, fmt.Errorf("SASL %s needs SASL.User (--kafka-sasl-user)", s.Mechanism))
	}
	if s.Password == "" {
		problems = append(problems, fmt.Errorf("SASL %s needs SASL.Password (ONCEFLOW_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file)", s.Mechanism))
	}
	var opt kgo.Opt
	switch strings.ToUpper(s.Mechanism) {
	case SASLPlain:
		opt = kgo.SASL(plain.Auth{User: s.User, Pass: s.Password}.AsMechanism())
	case SASLScramSHA256:
		opt = kgo.SASL(scram.Auth{User: s.User, Pass: s.Password}.AsSha256Mechanism())
	case SASLScramSHA512:
		opt = kgo.SASL(scram.Auth{User: s.User, Pass: s.Password}.AsSha512Mechanism())
	default:
		problems = append(problems, fmt.Errorf("SASL.Mechanism (--kafka-sasl-mechanism) %q: use PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", s.Mechanism))
	}
	return opt, problems
}

// compressionCodec maps a Config.Compression name to franz-go's codecs, falling back to none
// for brokers too old for the codec (zstd needs Kafka 2.1), as franz-go's default does.
func compressionCodec(name string) ([]kgo.CompressionCodec, error) {
	var c kgo.CompressionCodec
	switch strings.ToLower(name) {
	case "none":
		return []kgo.CompressionCodec{kgo.NoCompression()}, nil
	case "gzip":
		c = kgo.GzipCompression()
	case "", "snappy":
		c = kgo.SnappyCompression()
	case "lz4":
		c = kgo.Lz4Compression()
	case "zstd":
		c = kgo.ZstdCompression()
	default:
		return nil, fmt.Errorf("Compression (--kafka-compression) %q: use none, gzip, snappy, lz4 or zstd", name)
	}
	return []kgo.CompressionCodec{c, kgo.NoCompression()}, nil
}

// connection validates the fields that say how to reach the cluster (brokers, client id, TLS,
// SASL) and returns the franz-go options for them, or every problem found.
func (cfg Config) connection() ([]kgo.Opt, []error) {
	var problems []error
	if len(cfg.Brokers) == 0 || slices.Contains(cfg.Brokers, "") {
		problems = append(problems, errors.New("no Kafka brokers: set Brokers (--kafka-brokers / KAFKA_BROKERS), e.g. kafka-1:9092,kafka-2:9092"))
	}
	id := cfg.ClientID
	if id == "" {
		id = DefaultClientID
	}
	opts := []kgo.Opt{kgo.SeedBrokers(cfg.Brokers...), kgo.ClientID(id)}
	tlsCfg, ps := cfg.TLS.config()
	problems = append(problems, ps...)
	if tlsCfg != nil {
		opts = append(opts, kgo.DialTLSConfig(tlsCfg))
	}
	sasl, ps := cfg.SASL.mechanism()
	problems = append(problems, ps...)
	if sasl != nil {
		opts = append(opts, sasl)
	}
	return opts, problems
}

// ClientOpts returns the franz-go options that reach the cluster cfg describes — seed
// brokers, client id, TLS and SASL — for another client of the same cluster, such as an
// admin client that creates the topics. It validates those fields as NewSink does, reporting
// every problem at once in a *relay.ConfigError, and reads the TLS files. The producer
// fields (MaxMessageBytes, DeliveryTimeout, Compression, ...) and Opts are not used.
func (cfg Config) ClientOpts() ([]kgo.Opt, error) {
	opts, problems := cfg.connection()
	if len(problems) > 0 {
		return nil, &relay.ConfigError{Scope: "relaykafka", Problems: problems}
	}
	return opts, nil
}

// ConnectionError explains why a client of the cluster could not talk to it, naming the
// settings to check. Ping returns it; tools that use ClientOpts get it from Explain.
type ConnectionError struct {
	// Hint says what to check: the brokers, the TLS settings or the SASL credentials.
	Hint string
	// Err is franz-go's error.
	Err error
}

// Error is the hint followed by franz-go's error.
func (e *ConnectionError) Error() string { return e.Hint + ": " + e.Err.Error() }

// Unwrap returns franz-go's error.
func (e *ConnectionError) Unwrap() error { return e.Err }

// Explain wraps err, the failure of a request to the cluster cfg describes, in a
// *ConnectionError that says which settings to check: an authentication refused by the
// broker, a TLS handshake that failed, or a broker that closed the connection during
// authentication (what a wrong password looks like on some brokers). Nil stays nil.
func (cfg Config) Explain(err error) error {
	if err == nil {
		return nil
	}
	var (
		certErr  *tls.CertificateVerificationError
		hostErr  x509.HostnameError
		authErr  x509.UnknownAuthorityError
		recErr   tls.RecordHeaderError
		alertErr tls.AlertError
	)
	who := fmt.Sprintf("user %q, mechanism %s", cfg.SASL.User, strings.ToUpper(cfg.SASL.Mechanism))
	switch {
	case errors.Is(err, kerr.SaslAuthenticationFailed):
		return &ConnectionError{Hint: "Kafka refused the SASL credentials (" + who + "): check the user (--kafka-sasl-user) and the password (ONCEFLOW_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file)", Err: err}
	case errors.Is(err, kerr.UnsupportedSaslMechanism), errors.Is(err, kerr.IllegalSaslState):
		return &ConnectionError{Hint: "Kafka does not accept SASL mechanism " + strings.ToUpper(cfg.SASL.Mechanism) + " on this listener: use one it enables (--kafka-sasl-mechanism), or none if it has no SASL", Err: err}
	case errors.As(err, &recErr):
		return &ConnectionError{Hint: "the broker does not speak TLS on this port: turn TLS off, or give the address of its TLS listener (--kafka-brokers)", Err: err}
	case errors.As(err, &certErr), errors.As(err, &hostErr), errors.As(err, &authErr):
		return &ConnectionError{Hint: "the broker's TLS certificate was not accepted: give the CA that signed it (--kafka-tls-ca-file) and, when the broker's certificate names another host than the address, --kafka-tls-server-name", Err: err}
	case errors.As(err, &alertErr), strings.Contains(err.Error(), "remote error: tls:"):
		// The broker's alert (tls.alert is unexported): a missing or untrusted client
		// certificate, most of the time.
		return &ConnectionError{Hint: "the broker refused the TLS handshake: check whether it requires a client certificate (--kafka-tls-cert-file, --kafka-tls-key-file) and trusts its CA", Err: err}
	case cfg.SASL.Mechanism != "" && closedByPeer(err):
		return &ConnectionError{Hint: "Kafka closed the connection during SASL authentication (" + who + "): most likely a wrong user or password (ONCEFLOW_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file); else a listener that expects TLS (--kafka-tls) or has no SASL", Err: err}
	case cfg.TLS.enabled() && closedByPeer(err):
		return &ConnectionError{Hint: "Kafka closed the connection: check that the address is a TLS listener (--kafka-brokers) and whether it expects SASL (--kafka-sasl-mechanism)", Err: err}
	case cfg.TLS.enabled() && timedOut(err):
		// A plaintext listener reads a TLS hello as the start of a huge request and waits.
		return &ConnectionError{Hint: "no answer from Kafka over TLS: check that the address is a TLS listener, not a plaintext one, and reachable (--kafka-brokers)", Err: err}
	case closedByPeer(err):
		return &ConnectionError{Hint: "Kafka closed the connection: if the listener expects TLS, turn it on (--kafka-tls); if it expects SASL, set --kafka-sasl-mechanism", Err: err}
	}
	return &ConnectionError{Hint: "Kafka unreachable: check the brokers (--kafka-brokers) and the network", Err: err}
}

// timedOut reports whether err is a deadline: the caller's or the network's.
func timedOut(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
}

// closedByPeer reports whether err is the other side closing the connection.
func closedByPeer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}
