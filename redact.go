package sqlbroker

import (
	"net/url"
	"strings"
)

// redactMask stands in for every secret the library would otherwise show.
const redactMask = "xxxxx"

// secretParams are the connection parameters whose values are secrets, as pgx's and lib/pq's
// URL parsing read them: the password, the passphrase of an encrypted client key
// (sslpassword), and sslkey, which lib/pq reads as the private key itself when sslinline is
// set. They are matched case-insensitively and after percent-decoding, so that every spelling
// a driver may accept is covered (over-masking is harmless).
var secretParams = map[string]bool{"password": true, "sslpassword": true, "sslkey": true}

func isSecretParam(rawKey string) bool {
	k, err := url.QueryUnescape(rawKey)
	if err != nil {
		k = rawKey
	}
	return secretParams[strings.ToLower(strings.TrimSpace(k))]
}

// redactedURL is u as the library shows it: the userinfo password and the value of every
// secret query parameter replaced by redactMask.
func redactedURL(u *url.URL) string {
	c := *u
	if _, ok := c.User.Password(); ok {
		c.User = url.UserPassword(c.User.Username(), redactMask)
	}
	if c.RawQuery != "" {
		pairs := strings.Split(c.RawQuery, "&")
		for i, p := range pairs {
			if k, _, ok := strings.Cut(p, "="); ok && isSecretParam(k) {
				pairs[i] = k + "=" + redactMask
			}
		}
		c.RawQuery = strings.Join(pairs, "&")
	}
	return c.String()
}

// urlSecrets returns the secrets rawURL carries, each as written and percent-decoded: the
// userinfo password and the values of the secret query parameters.
func urlSecrets(rawURL string) []string {
	var out []string
	add := func(raw string) {
		if raw == "" {
			return
		}
		out = append(out, raw)
		for _, unescape := range []func(string) (string, error){url.PathUnescape, url.QueryUnescape} {
			if d, err := unescape(raw); err == nil && d != raw && d != "" {
				out = append(out, d)
			}
		}
	}
	_, rest, ok := strings.Cut(rawURL, "://")
	if !ok {
		rest = rawURL
	}
	// The userinfo ends at the first '@' before any '/', as the drivers read it.
	if i := strings.IndexAny(rest, "@/"); i >= 0 && rest[i] == '@' {
		if _, pw, ok := strings.Cut(rest[:i], ":"); ok {
			add(pw)
		}
		rest = rest[i+1:]
	}
	if _, query, ok := strings.Cut(rest, "?"); ok {
		for _, p := range strings.Split(query, "&") {
			if k, v, ok := strings.Cut(p, "="); ok && isSecretParam(k) {
				add(v)
			}
		}
	}
	return out
}

// redact removes every secret of rawURL from msg, wherever a driver echoed it.
func redact(msg, rawURL string) string {
	for _, s := range urlSecrets(rawURL) {
		msg = strings.ReplaceAll(msg, s, redactMask)
	}
	return msg
}
